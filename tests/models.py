"""Model builders and the training loop the tests share (imported as ``models``, beside ``conftest``)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import pytest
import torch
from torch import nn

from tblog_hooks import HookLogger


def mlp(*widths: int, act: Callable[[], nn.Module] | None = nn.Tanh, seed: int | None = None) -> nn.Sequential:
    """Linear layers through ``widths``, an ``act()`` (if any) between two; the RNG seeded first with ``seed``."""
    if seed is not None:
        torch.manual_seed(seed)  # the same initial weights wherever it is built (each rank, each reference)
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(widths):
        if layers and act is not None:
            layers.append(act())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def sigmoid_stack(depth: int, width: int) -> nn.Sequential:
    """``depth`` Linear-Sigmoid pairs of ``width`` and a 2-way head: the gradient vanishes towards the input."""
    return mlp(*[width] * (depth + 1), 2, act=nn.Sigmoid)


def conv_net(width: int = 4, *, classes: int = 3, batch_norm: bool = False, lazy: bool = False) -> nn.Sequential:
    """Conv blocks 3-4-``width`` on 3 x 8 x 8 images into a ``classes`` head (``lazy``: shaped by a first forward)."""
    first = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    second = nn.Sequential(nn.Conv2d(4, width, 3), *([nn.BatchNorm2d(width)] if batch_norm else []), nn.ReLU())
    head = nn.LazyLinear(classes) if lazy else nn.Linear(width * 4 * 4, classes)
    return nn.Sequential(first, second, nn.Flatten(), head)


def gpt2(width: int, vocab: int) -> nn.Module:
    """A 2-layer, 2-head Hugging Face GPT-2 for 16 tokens (``lm_head.weight`` is ``transformer.wte.weight``)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=16, n_embd=width, n_layer=2, n_head=2, use_cache=True
    )
    return transformers.GPT2LMHeadModel(config)  # type: ignore[no-any-return]


def bert(width: int, vocab: int) -> nn.Module:
    """A 2-layer, 2-head Hugging Face BERT masked LM for 16 tokens (a tied decoder weight)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=width, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=2 * width, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)  # type: ignore[no-any-return]


def timm_model(name: str, **config: object) -> nn.Module:
    """timm's ``name``, randomly initialised, with 10 classes."""
    timm = pytest.importorskip("timm")
    return timm.create_model(name, pretrained=False, num_classes=10, **config)  # type: ignore[no-any-return]


def train(hooks: HookLogger | None, losses: Iterable[torch.Tensor], opt: torch.optim.Optimizer | None = None) -> None:
    """A step per loss (computed as it is drawn): backward, ``opt.step()``, ``opt.zero_grad()``, ``hooks.step()``."""
    for loss in losses:
        loss.backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        if hooks is not None:
            hooks.step()


def optimizer_step(opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> None:
    """``opt.step()`` (through ``scaler.step`` and ``scaler.update`` when given), then ``opt.zero_grad()``."""
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    opt.zero_grad()


def lightning_trainer(tmp_path: object, callbacks: list[object], **args: object) -> object:
    """A quiet CPU ``lightning.pytorch.Trainer`` in ``tmp_path`` (logging every step, one epoch
    unless ``args`` say otherwise): no checkpoints, progress bar or model summary."""
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **{"max_epochs": 1, "log_every_n_steps": 1, **args},
    )
