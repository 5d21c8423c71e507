"""Data parallelism on the CPU with gloo (DDP and FSDP2 on two processes, HSDP on four): each rank's
share of a global batch of four, against one process with the whole batch. Every statistic is one
process's: the output gradients as of the averaged loss whose gradients the optimizer applies
(each rank's own are of its own mean loss, world-size times larger; under a loss normalised over
the global batch with FSDP2's divide factor set to 1, as torchtitan trains, they already are), and
with ``reduce_ranks=True`` the samples of a step are those of every rank."""

from __future__ import annotations

import datetime
import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_run, read_run, spawn_ranks
from models import mlp
from torch import nn

from tblog_hooks import HookLogger, Spikes

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
TIMEOUT = datetime.timedelta(seconds=30)
STEPS, SAMPLES = 3, 4  # a global batch of four samples a step
#: Every scalar of a step (numerics= of FSDP2's parameter gradients pooled over its shards), the
#: per-step series (the loss: the ranks' summed and divided as their gradients are).
SCALARS = ("activation/", "input/", "gradient/", "param_grad/", "param/")
SERIES = ("step/grad_norm", "step/samples", "step/loss")
UNPOOLED = "activation/median_abs/"
OPTIONS = {"every": 1, "numerics": ("bf16",), "spikes": Spikes(warmup=3, window=8)}


def _model() -> nn.Module:
    return mlp(6, 12, 12, 3, act=nn.ReLU, seed=0)


def _share(step: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s share of step ``step``'s global batch (all of it for ``world=1``)."""
    batch = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(step))
    return batch.chunk(world)[rank]


def _train(model: nn.Module, log_dir: str, rank: int, world: int, *, divide: int = 1, **options: object) -> None:
    """Steps on rank ``rank``'s shares of a ``world``; its mean loss divided by ``divide``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = STEPS if options.get("reduce_ranks", True) else 1
    with HookLogger(model, log_dir=log_dir, optimizer=opt, **OPTIONS, **options) as hooks:  # type: ignore[arg-type]
        for step in range(steps):
            loss = model(_share(step, rank, world)).square().mean() / divide
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)


def _sharded(mesh: object = None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    for layer in (model[0], model[2], model[4], model):
        fully_shard(layer, mesh=mesh)
    return model


def _ranks(rank: int, root: str, kind: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    for reduce in (True, False):
        if kind == "ddp":
            model = nn.parallel.DistributedDataParallel(_model())
        elif kind == "fsdp2_global":  # torchtitan's way: a loss normalised over the global batch, summed
            model = _sharded()
            for module in model.modules():
                if hasattr(module, "set_gradient_divide_factor"):
                    module.set_gradient_divide_factor(1.0)
                    module.set_force_sum_reduction_for_comms(True)  # (gloo has no PREMUL_SUM)
            _train(model, f"{root}/{reduce}", rank, world, divide=world, reduce_ranks=reduce)
            continue
        else:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if kind == "hsdp" else None
            model = _sharded(mesh)
        _train(model, f"{root}/{reduce}", rank, world, reduce_ranks=reduce)


@pytest.mark.parametrize("kind", ["ddp", "fsdp2", "hsdp", "fsdp2_global"])
def test_data_parallel_statistics_are_those_of_one_process(tmp_path: Path, kind: str) -> None:
    world = 4 if kind == "hsdp" else 2
    spawn_ranks(functools.partial(_ranks, kind=kind), tmp_path, world, TIMEOUT)
    _train(_model(), str(tmp_path / "whole"), 0, 1)
    whole = read_run(tmp_path / "whole")
    pooled, own = read_run(tmp_path / "True"), read_run(tmp_path / "False")
    # reduce_ranks=True: the scalars of every rank's calls, the averaged parameter gradients,
    # every rank's samples and the loss of the whole batch, as one process with the whole batch.
    # (A module's median |x| is not pooled over calls, only their largest: left out.)
    tags = tuple(t for t in whole.scalars if t.startswith(SCALARS + SERIES) and not t.startswith(UNPOOLED))
    assert_same_run(pooled, whole, range(STEPS), tags, histograms=False)
    assert pooled.scalars["step/samples"] == {step: float(SAMPLES) for step in range(STEPS)}
    # The writing rank's own calls (and histograms): those of its samples in the whole batch, whose
    # mean loss is its own divided by the world size.
    _train(_model(), str(tmp_path / "share"), 0, world, divide=world, reduce_ranks=False)
    assert_same_run(own, read_run(tmp_path / "share"), range(1), ("activation/", "gradient/", "gradient_log10/"))
