"""Real architectures: training is unchanged bit for bit, values are finite, the global gradient
norm is torch's, and no hook is left after close."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torchvision
from conftest import assert_same_weights, hook_dicts, read_run
from models import bert, gpt2, timm_model
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

from tblog_hooks import HookLogger

STEPS = 2  # the second step uses the momentum buffers of the first


@dataclass
class Case:
    make: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], Any]  # inputs drawn from their own generator, not the global RNG
    loss: Callable[[nn.Module, Any], Tensor]


def _classifier(make: Callable[[], nn.Module], size: int) -> Case:
    return Case(
        make,
        lambda g: (torch.randn(2, 3, size, size, generator=g), torch.randint(0, 10, (2,), generator=g)),
        lambda model, b: nn.functional.cross_entropy(model(b[0]), b[1]),
    )


def _detection() -> Case:
    def make() -> nn.Module:  # torchvision's Faster R-CNN (transform, RPN, RoI heads) on a small backbone
        from torchvision.models.detection import FasterRCNN
        from torchvision.models.detection.anchor_utils import AnchorGenerator

        backbone = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1), nn.ReLU())
        backbone.out_channels = 16
        return FasterRCNN(
            backbone, num_classes=3, min_size=96, max_size=96,
            rpn_anchor_generator=AnchorGenerator(sizes=((16, 32),), aspect_ratios=((0.5, 1.0, 2.0),)),
            box_roi_pool=torchvision.ops.MultiScaleRoIAlign(["0"], output_size=7, sampling_ratio=2),
            rpn_pre_nms_top_n_train=200, rpn_post_nms_top_n_train=50, box_batch_size_per_image=32,
        )  # fmt: skip

    def batch(g: torch.Generator) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
        images = [torch.rand(3, 96, 96, generator=g) for _ in range(2)]
        corners = torch.rand(2, 2, 2, generator=g) * 40
        boxes = [torch.cat([c[0], c[0] + 20 + c[1]]).reshape(1, 4) for c in corners]
        return images, [{"boxes": b, "labels": torch.tensor([1 + i])} for i, b in enumerate(boxes)]

    return Case(make, batch, lambda model, b: sum(model(*b).values()))  # train mode: a dict of losses


def _language_model(make: Callable[[], nn.Module]) -> Case:
    def loss(model: nn.Module, ids: Tensor) -> Tensor:
        return model(input_ids=ids, labels=ids).loss  # a ModelOutput (with a cache for GPT-2)

    return Case(make, lambda g: torch.randint(0, 64, (2, 12), generator=g), loss)


class _Recurrent(nn.Module):
    """Padded sequences of different lengths through an LSTM and a GRU as PackedSequence."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.lstm = nn.LSTM(8, 12, num_layers=2, batch_first=True)
        self.gru = nn.GRU(12, 12, batch_first=True, bidirectional=True)
        self.head = nn.Linear(24, 3)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        _, h = self.gru(out)
        return self.head(torch.cat([h[-2], h[-1]], dim=1))


def _recurrent() -> Case:
    def batch(g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
        return torch.randint(0, 20, (4, 7), generator=g), torch.tensor([7, 3, 5, 1]), torch.randint(0, 3, (4,))

    return Case(_Recurrent, batch, lambda model, b: nn.functional.cross_entropy(model(b[0], b[1]), b[2]))


class _Attention(nn.Module):
    """nn.TransformerEncoder with a padding mask, then a bare nn.MultiheadAttention (a tuple output)."""

    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.attention = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:
        h = self.encoder(x, src_key_padding_mask=padding)
        h, _ = self.attention(h, h, h, key_padding_mask=padding)
        return self.head(h).mean()


def _attention() -> Case:
    def batch(g: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(3, 6, 16, generator=g), torch.tensor([[False] * 6, [False] * 4 + [True] * 2, [False] * 6])

    return Case(_Attention, batch, lambda model, b: model(*b))


CASES = {
    "torchvision-mobilenet_v3_small": _classifier(lambda: torchvision.models.mobilenet_v3_small(num_classes=10), 32),
    "torchvision-fasterrcnn": _detection(),
    "timm-vit": _classifier(lambda: timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), 32),
    "timm-convnext": _classifier(
        lambda: timm_model("convnext_atto", drop_path_rate=0.1, depths=(1, 1, 2, 1), dims=(16, 32, 64, 128)), 32
    ),
    "transformers-gpt2": _language_model(lambda: gpt2(16, 64)),
    "transformers-bert": _language_model(lambda: bert(16, 64)),
    "lstm-gru-packed": _recurrent(),
    "transformer-encoder-mha": _attention(),
}


def _root_and_owners(name: str, module: nn.Module) -> bool:
    """The model itself (a dict of losses, a ModelOutput with a cache) and every module owning
    parameters, leaf or not (nn.MultiheadAttention, a ViT's class token)."""
    return name == "" or any(True for _ in module.parameters(recurse=False))


def _train(case: Case, log_dir: Any = None) -> tuple[nn.Module, list[float], HookLogger | None]:
    """STEPS optimizer steps from the same initial weights and RNG state; with a logger when log_dir."""
    torch.manual_seed(0)
    model = case.make().train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    hooks = None if log_dir is None else HookLogger(model, log_dir=log_dir, every=1, modules=_root_and_owners)
    watched = [] if hooks is None else _watched(model, hooks.module_names)
    norms = []
    torch.manual_seed(1)  # dropout, drop path, proposal sampling: the same draws in both runs
    g = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        case.loss(model, case.batch(g)).backward()
        if hooks is not None:
            grads = [p.grad for p in watched if p.grad is not None]
            each = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])  # (float64: exact)
            norms.append(torch.linalg.vector_norm(each).item())
        optimizer.step()
        optimizer.zero_grad()
        if hooks is not None:
            hooks.step()
    if hooks is not None:
        hooks.close()
        assert not any(hook_dicts(model, optimizer))
    return model, norms, hooks


def _watched(model: nn.Module, names: tuple[str, ...]) -> list[nn.Parameter]:
    """The parameters the logger reads: those the watched modules own, each once (tied weights)."""
    modules = {"root" if name == "" else name: module for name, module in model.named_modules()}  # as shown
    unique = {id(p): p for name in names for p in modules[name].parameters(recurse=False) if p.requires_grad}
    return list(unique.values())


def _global_hooks() -> list[dict]:
    from torch.nn.modules import module
    from torch.optim import optimizer

    return [
        module._global_forward_hooks,
        module._global_forward_pre_hooks,
        module._global_backward_hooks,
        module._global_backward_pre_hooks,
        optimizer._global_optimizer_pre_hooks,
        optimizer._global_optimizer_post_hooks,
    ]


@pytest.mark.parametrize("name", list(CASES))
def test_real_architecture(tmp_path, name: str) -> None:
    case = CASES[name]
    plain, _, _ = _train(case)
    logged, norms, hooks = _train(case, tmp_path)
    assert hooks is not None and hooks.closed
    assert_same_weights(plain, logged)

    run = read_run(tmp_path)
    assert run.scalars["param_grad/global_norm"] == pytest.approx(dict(enumerate(norms)), rel=1e-5)
    logged_tags = [tag for tag in run.scalars if tag.startswith(("activation/", "gradient/", "param"))]
    assert any(tag.startswith("gradient/norm/") for tag in logged_tags)
    for tag in logged_tags:
        values = run.scalars[tag]
        assert sorted(values) == list(range(STEPS)), tag
        assert all(math.isfinite(v) for v in values.values()), f"{tag}: {values}"
    assert not any(_global_hooks())
