"""CUDA: same numbers as on the CPU, and no host-device synchronisation in a logged step."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Iterator

import pytest
import torch
import torchvision
from conftest import needs_cuda, read_run
from models import mlp, train
from torch import nn

from tblog_hooks import Histograms, HookLogger
from tblog_hooks.stats.attention import attention_statistics
from tblog_hooks.stats.tags import HISTOGRAM_KINDS

pytestmark = needs_cuda
#: Every histogram kind on every logged step.
EVERY_HISTOGRAM = Histograms(every_logged=1, weights_every_logged=1, kinds=list(HISTOGRAM_KINDS))


def _losses(model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> Iterator[torch.Tensor]:
    return (nn.functional.cross_entropy(model(x), y) for _ in range(steps))


def test_cuda_values_match_cpu(tmp_path) -> None:
    torch.backends.cudnn.deterministic = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = torchvision.models.resnet18(num_classes=10)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    runs = {}
    for device in ("cpu", "cuda"):
        m = copy.deepcopy(model).to(device)
        with HookLogger(m, log_dir=tmp_path / device, every=1) as hooks:
            train(hooks, _losses(m, x.to(device), y.to(device), 1), torch.optim.SGD(m.parameters(), lr=0.01))
        runs[device] = read_run(tmp_path / device)
    cpu, gpu = runs["cpu"], runs["cuda"]
    assert set(cpu.scalars) == set(gpu.scalars)
    for tag in cpu.scalars:
        assert gpu.scalar(tag, 0) == pytest.approx(cpu.scalar(tag, 0), rel=1e-3, abs=1e-5), tag
    for tag in cpu.histograms:
        assert gpu.histograms[tag][0].num == pytest.approx(cpu.histograms[tag][0].num, rel=1e-6), tag


def test_logged_step_never_synchronises(tmp_path) -> None:
    model = torchvision.models.resnet18(num_classes=10).cuda()
    x, y = torch.randn(8, 3, 64, 64, device="cuda"), torch.randint(0, 10, (8,), device="cuda")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with HookLogger(model, log_dir=tmp_path, every=2, optimizer=opt) as hooks:
        warm_up = torch.optim.SGD(model.parameters(), lr=0.01)
        train(hooks, _losses(model, x, y, 2), warm_up)  # allocators and cuDNN, outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            train(hooks, _losses(model, x, y, 4), opt)  # two logged, two not; step() packs and starts the async copy
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert sorted(read_run(tmp_path).scalars["param_grad/global_norm"]) == [0, 2, 4]


def test_pending_copies_are_written_at_close(tmp_path) -> None:
    model = mlp(64, 64, 4, act=nn.ReLU).cuda()
    x, y = torch.randn(32, 64, device="cuda"), torch.randint(0, 4, (32,), device="cuda")
    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        train(hooks, _losses(model, x, y, 5), torch.optim.SGD(model.parameters(), lr=0.01))
    assert sorted(read_run(tmp_path).scalars["activation/mean/0"]) == [0, 1, 2, 3, 4]


def _mlp_run(log_dir, device: torch.device, *, stream: torch.cuda.Stream | None = None) -> None:
    """Three logged steps of an MLP with every histogram kind; with ``stream``, trained on it, and
    ``step()`` called outside it while the stream goes on writing fresh memory (what it would
    reuse of the records' blocks, were they not marked used by the packing stream)."""
    model = mlp(32, 64, 64, 8, act=nn.ReLU, seed=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    xs = torch.randn(3, 16, 32, generator=data).to(device)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())  # the weights and data made on the default stream
    with HookLogger(model, log_dir=log_dir, every=1, inputs=True, histograms=EVERY_HISTOGRAM) as hooks:
        for x in xs:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            if stream is not None:
                torch.cuda._sleep(50_000_000)  # the packing kernels queued behind ~tens of ms of work
            hooks.step()
            if stream is not None:
                with torch.cuda.stream(stream):
                    garbage = [torch.full((n,), 7e6, device=device) for n in range(1, 2000)]
                del garbage
    torch.cuda.synchronize()


def _assert_same_runs(got: object, want: object) -> None:
    assert set(got.scalars) == set(want.scalars)  # type: ignore[attr-defined]
    for tag, by_step in want.scalars.items():  # type: ignore[attr-defined]
        assert got.scalars[tag] == pytest.approx(by_step, rel=1e-5, abs=1e-7), tag  # type: ignore[attr-defined]
    assert set(got.histograms) == set(want.histograms)  # type: ignore[attr-defined]
    for tag, by_step in want.histograms.items():  # type: ignore[attr-defined]
        for step, h in by_step.items():
            g = got.histograms[tag][step]  # type: ignore[attr-defined]
            assert (g.min, g.max, g.num) == pytest.approx((h.min, h.max, h.num), rel=1e-5), (tag, step)


def test_deterministic_mode_logs_histograms_and_scalars(tmp_path, monkeypatch) -> None:
    """``torch.histc`` raises on CUDA under deterministic algorithms: the histograms are binned
    without it, and count what they count otherwise."""
    device = torch.device("cuda")
    _mlp_run(tmp_path / "default", device)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS matmuls' own condition
    torch.use_deterministic_algorithms(True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="tblog_hooks")  # no "logging ... failed" warning
            _mlp_run(tmp_path / "deterministic", device)
    finally:
        torch.use_deterministic_algorithms(False)
    got, want = read_run(tmp_path / "deterministic"), read_run(tmp_path / "default")
    assert {tag.split("/")[0] for tag in got.histograms} == set(HISTOGRAM_KINDS)
    _assert_same_runs(got, want)
    for tag, by_step in want.histograms.items():
        for step, h in by_step.items():
            assert list(got.histograms[tag][step].bucket) == list(h.bucket), (tag, step)


def test_training_on_a_side_stream_logs_its_own_values(tmp_path) -> None:
    device = torch.device("cuda")
    _mlp_run(tmp_path / "default", device)
    _mlp_run(tmp_path / "side", device, stream=torch.cuda.Stream())
    _assert_same_runs(read_run(tmp_path / "side"), read_run(tmp_path / "default"))


def test_attention_logits_are_full_float32_under_tf32(tmp_path) -> None:
    """Under ``set_float32_matmul_precision("high")`` cuBLAS would use TF32 (a largest logit off
    by ~1e-3); the recompute matches a float64 reference to float32 rounding."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 8, 128, 64, generator=gen) * 4, torch.randn(2, 8, 128, 64, generator=gen) * 4
    want = attention_statistics(q.double(), k.double())
    torch.set_float32_matmul_precision("high")
    try:
        got = attention_statistics(q.cuda(), k.cuda())
        assert torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double().cpu(), w, rtol=5e-6, atol=0)  # TF32: ~2e-4
