"""What a logged step costs on the device and how faithful its histograms are, on a stock
ResNet-18 with defaults: histograms against exact histograms of the full tensors over the same
bucket edges, and the aten ops (kernel launches on a GPU) a logged step adds."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torchvision
from conftest import OpCounter, read_run
from models import train
from torch import nn

from tblog_hooks import Histograms, HookLogger
from tblog_hooks.stats.tags import HISTOGRAM_KINDS

RECORDED = [kind for kind in HISTOGRAM_KINDS if kind != "input"]  # every kind but inputs (inputs=False)


def _resnet() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    model = torchvision.models.resnet18(num_classes=10)
    return model, torch.randn(16, 3, 64, 64), torch.randint(0, 10, (16,))


def _ops_per_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, hooks: HookLogger | None) -> Counter[str]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with OpCounter() as counter:
        train(hooks, [nn.functional.cross_entropy(model(x), y)], optimizer)
    return counter.ops


def test_a_logged_step_adds_few_ops_per_module_and_an_unlogged_step_none(tmp_path: Path) -> None:
    model, x, y = _resnet()
    baseline = sum(_ops_per_step(model, x, y, None).values())
    with HookLogger(model, log_dir=tmp_path, every=2) as hooks:
        modules = len(hooks.module_names)
        first = _ops_per_step(model, x, y, hooks)  # step 0: logged (the first one, caches cold)
        unlogged = _ops_per_step(model, x, y, hooks)  # step 1
        steady = _ops_per_step(model, x, y, hooks)  # step 2: logged
    for logged in (first, steady):
        added = sum(logged.values()) - baseline
        assert added <= 24 * modules, f"{added / modules:.1f} ops per module: {logged.most_common(15)}"
    assert sum(unlogged.values()) == baseline


def _exact_counts(values: np.ndarray, limits: list[float]) -> np.ndarray:
    """Counts of the finite ``values`` in buckets with right edges ``limits``; the outer buckets
    are open-ended (as a chart shows them)."""
    index = np.searchsorted(np.asarray(limits), values[np.isfinite(values)], side="right")
    return np.bincount(np.minimum(index, len(limits) - 1), minlength=len(limits))


def test_histograms_are_faithful_to_the_full_tensors(tmp_path: Path) -> None:
    model, x, y = _resnet()
    exact: dict[str, np.ndarray] = {}
    with HookLogger(model, log_dir=tmp_path, every=1, histograms=Histograms(kinds=RECORDED)) as hooks:
        names = dict(model.named_modules())

        def keep(name: str):  # type: ignore[no-untyped-def]
            def hook(module: nn.Module, args: object, out: torch.Tensor) -> None:
                exact[f"activation/{name}"] = out.detach().double().numpy().copy()
                out.register_hook(lambda g: exact.__setitem__(f"gradient/{name}", g.double().numpy().copy()))

            return hook

        for name in hooks.module_names:  # registered after the logger's hooks: same tensors, before in-place ops
            names[name].register_forward_hook(keep(name))
        train(hooks, [nn.functional.cross_entropy(model(x), y)], torch.optim.SGD(model.parameters(), lr=0.01))
    histograms = read_run(tmp_path).histograms
    distances = {}
    for tag, full in exact.items():
        logged = histograms[tag][0]
        finite = full[np.isfinite(full)]
        assert (logged.min, logged.max, logged.num) == (finite.min(), finite.max(), finite.size), tag
        truth = _exact_counts(full.reshape(-1), list(logged.bucket_limit))
        distances[tag] = 0.5 * np.abs(np.asarray(logged.bucket) / logged.num - truth / truth.sum()).sum()
    worst = max(distances, key=distances.__getitem__)
    assert len(distances) == 2 * len(hooks.module_names)
    assert np.median(list(distances.values())) <= 0.02
    assert distances[worst] <= 0.05, (worst, distances[worst])
