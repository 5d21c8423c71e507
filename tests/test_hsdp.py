"""HSDP (FSDP2 on a replicate x shard mesh), four processes on the CPU with gloo: parameter-gradient
norms are those of the averaged gradient, summed over the shards and never over the replicas."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import read_run, spawn_ranks
from models import mlp
from torch import nn

from tblog_hooks import HookLogger

WORLD = 4
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _batch(rank: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))


def _hsdp(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = mlp(16, 32, 32, 8, act=nn.ReLU, seed=0)
    for layer in (model[0], model[2], model[4], model):
        fully_shard(layer, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=f"{root}/run", every=1, optimizer=opt, histograms=False) as hooks:
        model(_batch(rank)).square().mean().backward()
        opt.step()
        hooks.step()


def test_hsdp_parameter_gradient_norms_are_those_of_one_process(tmp_path: Path) -> None:
    spawn_ranks(_hsdp, tmp_path, WORLD)
    model = mlp(16, 32, 32, 8, act=nn.ReLU, seed=0)
    for rank in range(WORLD):  # the gradient HSDP averages over every rank's batch
        (model(_batch(rank)).square().mean() / WORLD).backward()
    run = read_run(tmp_path / "run")
    norms = {f"param_grad/norm/{name}": p.grad.double().norm() for name, p in model.named_parameters()}
    for tag, value in norms.items():
        assert run.scalar(tag, 0) == pytest.approx(float(value), rel=1e-5), tag
    total = torch.stack(list(norms.values())).norm()
    assert run.scalar("param_grad/global_norm", 0) == pytest.approx(float(total), rel=1e-5)
