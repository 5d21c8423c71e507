"""Healthy real architectures, initialised as their libraries do, raise no health finding.

Each model trains 40 optimizer steps of AdamW (lr 1e-3) on generated data with the logger's
defaults, except that ``optimizer=`` is given (so the update-size rule is judged too) and
histograms are off (no rule reads them); GPT-2 and ResNet-50 also with ``numerics=True``, in
float32 and under bf16 autocast (the low-precision rules judged too; every model here is silent
with it, checked when they were written, but it doubles a logged step's time on the CPU). Small
configurations and inputs, and logging every 2nd or 4th step for the larger models, keep the
file inside the CI budget; with ``every=1`` and stock widths the rules hold too (checked when
they were written). The architectures keep
what fooled earlier rules: layer scale (ConvNeXt), zero-initialised residual branches (timm
``resnet18d``), a zero-initialised classifier (torchvision ViT), attention projections with
tiny gradients at init (BERT), modules that never run their own forward
(``MultiheadAttention.out_proj``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import pytest
import torch
import torchvision
from models import bert, gpt2, timm_model, train
from torch import Tensor, nn

from tblog_hooks import HookLogger
from tblog_hooks.diagnostics.findings import Finding
from tblog_hooks.diagnostics.health import Health
from tblog_hooks.diagnostics.per_step import gradient_norms

STEPS = 40
VOCAB, TOKENS = 128, 16


@dataclass
class Case:
    model: nn.Module
    batch: Callable[[], tuple[Tensor, Tensor]]  # inputs, targets
    loss: Callable[[nn.Module, Tensor, Tensor], Tensor]
    every: int = 1
    #: The smallest output-gradient norm relative to the largest at some step is below this:
    #: the old "1e-4 of the largest anywhere" rule would have reported it.
    old_rule_fired: bool = False


def _images(batch: int = 8, size: int = 32) -> Callable[[], tuple[Tensor, Tensor]]:
    return lambda: (torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,)))


def _tokens() -> tuple[Tensor, Tensor]:
    ids = torch.randint(0, VOCAB, (4, TOKENS))
    return ids, ids


def _classify(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return nn.functional.cross_entropy(model(x), y)


def _hf_loss(model: nn.Module, ids: Tensor, labels: Tensor) -> Tensor:
    return model(input_ids=ids, labels=labels).loss  # type: ignore[no-any-return]


class _Encoder(nn.Module):
    """``nn.TransformerEncoder`` as a token model: embedding, 2 layers, vocabulary head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 2, 64, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(ids))).flatten(0, 1)  # type: ignore[no-any-return]


def _convnext_t() -> nn.Module:
    """ConvNeXt-T (depths 3-3-9-3, layer scale 1e-6, stochastic depth 0.1) at a quarter of its widths."""
    from torchvision.models.convnext import CNBlockConfig, ConvNeXt

    widths = [(24, 48, 3), (48, 96, 3), (96, 192, 9), (192, None, 3)]
    return ConvNeXt([CNBlockConfig(*w) for w in widths], stochastic_depth_prob=0.1, num_classes=10)


def _efficientnet_b0() -> nn.Module:
    """EfficientNet-B0's blocks (torchvision's table) at half its widths."""
    from torchvision.models.efficientnet import EfficientNet, MBConvConfig

    blocks = [(1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
              (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1)]  # fmt: skip
    return EfficientNet([MBConvConfig(*b, width_mult=0.5, depth_mult=1.0) for b in blocks], 0.2, num_classes=10)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=VOCAB,
        max_position_embeddings=TOKENS,
    )
    return LlamaForCausalLM(config)


CASES: dict[str, Callable[[], Case]] = {
    # ResNet-50 with the bottleneck width of a quarter (torchvision's own `width_per_group`).
    "resnet50": lambda: Case(
        torchvision.models.resnet50(num_classes=10, width_per_group=16), _images(), _classify, every=4
    ),
    "convnext_t": lambda: Case(_convnext_t(), _images(), _classify, every=2, old_rule_fired=True),
    "efficientnet_b0": lambda: Case(_efficientnet_b0(), _images(), _classify, every=2),
    # DenseNet-121's blocks (6-12-24-16) with growth rate 8 instead of 32.
    "densenet121": lambda: Case(
        torchvision.models.DenseNet(8, (6, 12, 24, 16), 16, num_classes=10), _images(), _classify, every=4
    ),
    "vit": lambda: Case(
        torchvision.models.VisionTransformer(
            32, 8, num_layers=4, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=10
        ),
        _images(),
        _classify,
        old_rule_fired=True,
    ),
    # resnet18d (deep stem, average-pool shortcuts, zero-initialised last BatchNorm per block) at a quarter width.
    "timm_resnet18d": lambda: Case(
        timm_model("resnet18d", channels=(16, 32, 64, 128), stem_width=8),
        _images(),
        _classify,
        every=2,
        old_rule_fired=True,
    ),
    "timm_convnext_atto": lambda: Case(timm_model("convnext_atto"), _images(), _classify, every=2, old_rule_fired=True),
    "gpt2": lambda: Case(gpt2(32, VOCAB), _tokens, _hf_loss),
    "bert_mlm": lambda: Case(bert(32, VOCAB), _tokens, _hf_loss, old_rule_fired=True),
    "llama": lambda: Case(_llama(), _tokens, _hf_loss),
    "transformer_encoder": lambda: Case(
        _Encoder(), _tokens, lambda m, x, y: nn.functional.cross_entropy(m(x), y.flatten())
    ),
}


#: The models also trained with ``numerics=True``, in float32 and in bf16.
LOW_PRECISION = ("gpt2", "resnet50")


@pytest.mark.parametrize("name", list(CASES))
def test_a_healthy_model_raises_no_finding(tmp_path, monkeypatch, name: str) -> None:
    _check_healthy(tmp_path, monkeypatch, CASES[name](), numerics=name in LOW_PRECISION)


@pytest.mark.parametrize("name", LOW_PRECISION)
def test_a_healthy_model_in_bf16_raises_no_finding(tmp_path, monkeypatch, name: str) -> None:
    """Under bf16 autocast ``numerics=True`` judges bf16 (and the massive activations)."""
    _check_healthy(tmp_path, monkeypatch, CASES[name](), steps=STEPS // 2, numerics=True, autocast=torch.bfloat16)


def _check_healthy(  # type: ignore[no-untyped-def]
    tmp_path, monkeypatch, case: Case, *, steps: int = STEPS, numerics: bool, autocast: torch.dtype | None = None
) -> None:
    """Train ``case`` ``steps`` steps (in float32, or under ``autocast``) and check that no finding
    starts although every logged step gave the rules their evidence."""
    seen: list[Mapping[str, float]] = []  # the scalars each logged step gave the health rules
    judge = Health.update

    def spy(
        self: Health, step: int, scalars: Mapping[str, float], order: Sequence[str], heads: object = None
    ) -> list[Finding]:
        seen.append(dict(scalars))
        return judge(self, step, scalars, order, heads)  # type: ignore[arg-type]

    monkeypatch.setattr(Health, "update", spy)
    opt = torch.optim.AdamW(case.model.parameters(), lr=1e-3)

    def loss() -> Tensor:
        if autocast is None:
            return case.loss(case.model, *case.batch())
        with torch.autocast("cpu", dtype=autocast):
            return case.loss(case.model, *case.batch()).float()

    # Histograms off: no rule reads them, and they would double the time of a logged step.
    with HookLogger(
        case.model, log_dir=tmp_path, every=case.every, optimizer=opt, histograms=False, numerics=numerics
    ) as hooks:
        train(hooks, (loss() for _ in range(steps)), opt)
    assert hooks.findings == []
    # The rules were exercised: every logged step has gradient norms and update ratios.
    assert len(seen) == steps // case.every
    smallest = math.inf
    for scalars in seen:
        norms = gradient_norms(scalars)
        assert len(norms) >= 10 and any(t.startswith("param/update_ratio/") for t in scalars)
        assert numerics == any(t.startswith("activation/underflow_bf16/") for t in scalars)  # (judged)
        smallest = min(smallest, min(norms.values()) / max(norms.values()))
    assert (smallest < 1e-4) == case.old_rule_fired
