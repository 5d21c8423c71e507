"""No hook reads a tensor value on the host.

Two independent witnesses: a ``TorchFunctionMode`` (sees the forward hooks' torch calls)
and patched ``Tensor`` methods (also see tensor and parameter hooks inside backward,
which torch function modes do not reach), counting host reads made from this package.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torchvision
from conftest import needs_cuda, read_run, read_tags
from models import mlp
from torch import nn
from torch.overrides import TorchFunctionMode

import tblog_hooks
from tblog_hooks import Histograms, HookLogger
from tblog_hooks.stats.tags import HISTOGRAM_KINDS

_PACKAGE = str(Path(tblog_hooks.__file__).parent)
_HOST_READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


class SeenOps(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.seen.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads_from_package(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    reads: list[str] = []
    for name in _HOST_READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _name=name, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            if sys._getframe(1).f_code.co_filename.startswith(_PACKAGE):
                reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    try:
        yield reads
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("extras", [False, True])
def test_hooks_of_a_logged_step_never_read_values_on_the_host(tmp_path, monkeypatch, extras: bool) -> None:
    model = torchvision.models.resnet18(num_classes=4)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([0, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    # extras: input statistics, feature maps and the optimizer's hooks (update ratio) as well.
    options = {"optimizer": opt, "inputs": True, "feature_maps": "layer1.0.conv1"} if extras else {}
    with HookLogger(model, log_dir=tmp_path, every=1, **options) as hooks:  # type: ignore[arg-type]
        mode = SeenOps()
        with host_reads_from_package(monkeypatch) as reads, mode:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        hooks.step()
    assert {"aminmax", "count_nonzero", "linalg_vector_norm", "register_hook"} <= mode.seen
    if extras:
        assert {"_foreach_sub_", "nan_to_num_"} <= mode.seen  # the update ratio and feature map ran
    assert reads == []


def test_the_witness_catches_a_host_read_in_a_backward_hook(monkeypatch) -> None:
    # A hook whose code claims to live in the package, reading a value as a careless hook would.
    namespace: dict[str, object] = {}
    exec(compile("def hook(grad):\n    grad.sum().item()\n", f"{_PACKAGE}/probe.py", "exec"), namespace)
    t = torch.ones(3, requires_grad=True)
    t.register_hook(namespace["hook"])  # type: ignore[arg-type]
    with host_reads_from_package(monkeypatch) as reads:
        (t * 2).sum().backward()
    assert reads == ["item"]


@pytest.mark.parametrize("reentrant", [True, False])
def test_amp_checkpointing_and_eval_passes_never_read_values_on_the_host(tmp_path, monkeypatch, reentrant) -> None:
    from torch.utils.checkpoint import checkpoint

    model = mlp(8, 16, 4, act=nn.ReLU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(4, 8, requires_grad=True)
    with HookLogger(model, log_dir=tmp_path, every=1, scaler=scaler) as hooks:
        for _ in range(2):
            with host_reads_from_package(monkeypatch) as reads:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = checkpoint(model, x, use_reentrant=reentrant)
                scaler.scale(out.float().square().mean()).backward()
                with torch.no_grad():
                    model(x)
            assert reads == []
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            hooks.step()
    run = read_run(tmp_path)  # the hooks did their work in those passes
    assert set(run.scalars["activation/mean/0"]) == set(run.scalars["gradient/norm/2"]) == {0, 1}


@needs_cuda
def test_no_cuda_synchronisation_inside_a_logged_step(tmp_path) -> None:
    # CUDA's own witness: with sync debug mode "error", any synchronising call raises.
    model = torchvision.models.resnet18(num_classes=4).cuda()
    x, y = torch.randn(2, 3, 32, 32, device="cuda"), torch.tensor([0, 3], device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    options = {"optimizer": opt, "inputs": True, "feature_maps": "layer1.0.conv1"}
    with HookLogger(model, log_dir=tmp_path, every=1, **options) as hooks:  # type: ignore[arg-type]
        for _ in range(2):  # the first step warms up cuDNN and the optimizer state
            torch.cuda.set_sync_debug_mode("error" if hooks.global_step else "default")
            try:
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            hooks.step()
    run = read_run(tmp_path)
    assert set(run.scalars["param/update_ratio/conv1.weight"]) == {0, 1}
    assert "feature_map/layer1.0.conv1" in read_tags(tmp_path)["images"]


@needs_cuda
@pytest.mark.parametrize("deterministic", [False, True])
def test_no_cuda_synchronisation_in_a_logged_step_with_every_histogram(tmp_path, monkeypatch, deterministic) -> None:
    """The binning (``histc``, or the sort and binary search of deterministic mode), the sample
    and row indices copied from pinned memory, and the packed copy: none synchronises."""
    if deterministic:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    model = mlp(64, 128, 128, 10, act=nn.ReLU, seed=0).cuda()
    x = torch.randn(256, 64, device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kinds = list(HISTOGRAM_KINDS)
    options = {
        "optimizer": opt,
        "inputs": True,
        "histograms": Histograms(every_logged=1, weights_every_logged=1, kinds=kinds),
    }
    torch.use_deterministic_algorithms(deterministic)
    try:
        with HookLogger(model, log_dir=tmp_path, every=1, **options) as hooks:  # type: ignore[arg-type]
            for _ in range(2):  # the first step makes the index tensors (pinned copies) and the optimizer state
                torch.cuda.set_sync_debug_mode("error" if hooks.global_step else "default")
                try:
                    model(x).square().mean().backward()  # (NLLLoss has no deterministic CUDA kernel)
                    opt.step()
                    opt.zero_grad()
                    hooks.step()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
    finally:
        torch.use_deterministic_algorithms(False)
    histograms = read_run(tmp_path).histograms
    assert {tag.split("/")[0] for tag in histograms} == set(kinds)
    assert all(set(by_step) == {0, 1} for by_step in histograms.values())
