"""Two processes on the CPU with gloo: DDP and FSDP2 give the numbers of one process on all the data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import read_run
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger, HookLoggerError

WORLD = 2
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: nn.Module, hooks: HookLogger, opt: torch.optim.Optimizer, rank: int) -> None:
    for step in range(2):
        model(_batch(rank, step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        hooks.step()


def _worker(rank: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=WORLD)
    try:
        ddp = nn.parallel.DistributedDataParallel(_model())
        with pytest.raises(HookLoggerError, match="pass optimizer="):  # .grad is averaged only by then
            HookLogger(ddp, log_dir=f"{root}/never")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        with HookLogger(ddp, log_dir=f"{root}/ddp{rank}", every=1, optimizer=opt, reduce_ranks=True) as hooks:
            _train(ddp, hooks, opt, rank)

        model = _model()
        for layer in (model[0], model[2], model):
            fully_shard(layer)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        # Rank 1 writes too when handed a writer of its own.
        where = {"log_dir": f"{root}/fsdp0"} if rank == 0 else {"writer": SummaryWriter(f"{root}/given1")}
        with HookLogger(model, every=1, optimizer=opt, **where) as hooks:  # type: ignore[arg-type]
            _train(model, hooks, opt, rank)
        dist.barrier()  # neither rank tears the store down while the other still uses it
    finally:
        dist.destroy_process_group()


def _reference() -> dict[str, float]:
    """Step 0 on one process: gradients averaged over the ranks' batches, activations of all of them."""
    model = _model()
    outs = []
    for rank in range(WORLD):
        h = model[0](_batch(rank, 0))
        outs.append(h.detach())
        (model[2](model[1](h)).square().mean() / WORLD).backward()
    pooled = torch.cat(outs).double()
    norms = {
        f"param_grad/norm/{m}.{p}": float(getattr(model[m], p).grad.double().norm())
        for m in (0, 2)
        for p in ("weight", "bias")
    }
    return {**norms, "activation/mean/0": float(pooled.mean()), "activation/std/0": float(pooled.std())}


def test_ddp_and_fsdp2_on_two_cpu_processes(tmp_path: Path) -> None:
    mp.spawn(_worker, args=(str(tmp_path),), nprocs=WORLD)
    assert not (tmp_path / "ddp1").exists() and not (tmp_path / "never").exists()  # only rank 0 writes
    expected = _reference()
    ddp, fsdp, given = (read_run(tmp_path / name) for name in ("ddp0", "fsdp0", "given1"))
    for tag, value in expected.items():
        assert ddp.scalar(tag, 0) == pytest.approx(value, rel=1e-5), tag  # reduce_ranks: pooled over ranks
        if tag.startswith("param_grad"):
            assert fsdp.scalar(tag, 0) == pytest.approx(value, rel=1e-5), tag  # shards' norms combined
            assert given.scalar(tag, 0) == pytest.approx(value, rel=1e-5), tag  # on every rank
    assert ddp.histograms["activation/0"][0].num == 4 * 12  # histograms are rank 0's
    assert set(fsdp.scalars["param_grad/global_norm"]) == {0, 1}
