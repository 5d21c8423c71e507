"""CUDA: same numbers as on the CPU, and no host-device synchronisation in a logged step."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
import torchvision
from conftest import needs_cuda, read_run
from models import mlp, train
from torch import nn

from tblog_hooks import HookLogger

pytestmark = needs_cuda


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
