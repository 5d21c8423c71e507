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


class OutOfOrder(nn.Module):
    """Three Linears registered in one order (``c``, ``b/5%``, ``a``) and called in another,
    :data:`FORWARD`, which is not their names' order either; ``b/5%`` is escaped in tags."""

    #: The order their forward hooks fire in.
    FORWARD = ("b/5%", "a", "c")

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        for name in ("c", "b/5%", "a"):
            self.add_module(name, nn.Linear(width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.FORWARD:
            x = torch.tanh(getattr(self, name)(x))
        return x


def out_of_order_run(log_dir: object, steps: int = 2) -> None:
    """:class:`OutOfOrder` logged every step for ``steps`` steps into ``log_dir``."""
    torch.manual_seed(0)
    model = OutOfOrder()
    with HookLogger(model, log_dir=log_dir, every=1) as hooks:
        train(hooks, (model(torch.randn(8, 4)).square().mean() for _ in range(steps)))


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


class _Attention(nn.Module):
    """torchtitan's attention: query, key, value and output projections around SDPA, the heads
    rotated by a table that ``Llama`` passes in (``-1`` heads: this rank's, under tensor parallelism)."""

    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.head_dim, self.causal = dim // heads, causal
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, -1, self.head_dim) for f in (self.wq, self.wk, self.wv))
        q, k = q * freqs[:, None], k * freqs[:, None]
        out = nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=self.causal)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))  # type: ignore[no-any-return]


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention, self.feed_forward = _Attention(dim, heads, causal), _FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))  # type: ignore[no-any-return]


class _Head(nn.Module):
    """The final norm and the output projection: a parent that takes the sequence piece of each
    rank and returns the whole logits under torchtitan's plan."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.output = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(h))  # type: ignore[no-any-return]


class Llama(nn.Module):
    """A tiny Llama laid out as torchtitan's (``tok_embeddings``, ``layers`` of blocks with
    ``attention_norm``, ``attention.wq`` ... ``ffn_norm``, ``feed_forward.w1`` ...), the final norm
    and output projection inside ``head``; float64, seeded."""

    def __init__(
        self, *, dim: int = 16, heads: int = 4, layers: int = 2, vocab: int = 32, seq: int = 8, causal: bool = True
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): _Block(dim, heads, causal) for i in range(layers)})
        self.head = _Head(dim, vocab)
        angles = torch.arange(seq)[:, None] * torch.linspace(0.1, 1.0, dim // heads)
        self.register_buffer("freqs", angles.cos() + 1.5, persistent=False)
        self.double()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs)
        return self.head(h)  # type: ignore[no-any-return]


def parallelize_llama(model: Llama, mesh: object, *, loss_parallel: bool = False) -> Llama:
    """torchtitan's tensor- and sequence-parallel plan (``parallelize_llama``'s ``apply_tp``):
    a ``RowwiseParallel`` embedding into sequence pieces, ``SequenceParallel`` norms,
    ``PrepareModuleInput`` gathering the sequence for attention and feed-forward, a
    ``ColwiseParallel`` output of whole logits (or, with ``loss_parallel``, of vocabulary pieces
    as a ``DTensor``)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "head.norm": SequenceParallel(),
        "head.output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    parallelize_module(model, mesh, top)  # type: ignore[arg-type]
    for block in model.layers.values():
        plan = {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        }
        parallelize_module(block, mesh, plan)  # type: ignore[arg-type]
    return model
