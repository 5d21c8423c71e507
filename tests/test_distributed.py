"""Two processes on the CPU with gloo: DDP and FSDP2 give the numbers of one process on all the data."""

from __future__ import annotations

import datetime
import errno
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import read_run, spawn_ranks
from models import mlp, train
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger, HookLoggerError

WORLD = 2
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")


# A short timeout: a regression that enters a collective alone fails in seconds, not 30 minutes.
TIMEOUT = datetime.timedelta(seconds=20)


def _batch(rank: int, step: int, inputs: int = 6) -> torch.Tensor:
    return torch.randn(4, inputs, generator=torch.Generator().manual_seed(100 * step + rank))


def _losses(model: nn.Module, rank: int, inputs: int = 6) -> Iterator[torch.Tensor]:
    """The losses of two steps on the rank's own batches."""
    return (model(_batch(rank, step, inputs)).square().mean() for step in range(2))


def _worker(rank: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    ddp = nn.parallel.DistributedDataParallel(mlp(6, 12, 3, seed=0))
    with pytest.raises(HookLoggerError, match="pass optimizer="):  # .grad is averaged only by then
        HookLogger(ddp, log_dir=f"{root}/never")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    options = {"optimizer": opt, "reduce_ranks": True, "numerics": ("bf16", "e4m3")}
    with HookLogger(ddp, log_dir=f"{root}/ddp{rank}", every=1, **options) as hooks:  # type: ignore[arg-type]
        train(hooks, _losses(ddp, rank), opt)

    model = mlp(6, 12, 3, seed=0)
    for layer in (model[0], model[2], model):
        fully_shard(layer)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Rank 1 writes too when handed a writer of its own.
    given = SummaryWriter(f"{root}/given1") if rank == 1 else None
    where = {"writer": given} if given is not None else {"log_dir": f"{root}/fsdp0"}
    with HookLogger(model, every=1, optimizer=opt, numerics=True, **where) as hooks:  # type: ignore[arg-type]
        train(hooks, _losses(model, rank), opt)
    if given is not None:
        given.close()


def _reference() -> dict[str, float]:
    """Step 0 on one process: gradients averaged over the ranks' batches, activations of all of them."""
    model = mlp(6, 12, 3, seed=0)
    outs = []
    for rank in range(WORLD):
        h = model[0](_batch(rank, 0))
        outs.append(h.detach())
        (model[2](model[1](h)).square().mean() / WORLD).backward()
    pooled = torch.cat(outs).double()
    m2, m4 = float(pooled.square().mean()), float(pooled.pow(4).mean())
    numerics = {  # reduce_ranks=True: of both ranks' calls (each scaled by its own amax for e4m3)
        "activation/amax/0": float(pooled.abs().max()),
        "activation/rms/0": m2**0.5,
        "activation/kurtosis/0": m4 / m2**2 - 3,
        "activation/underflow_bf16/0": float(((pooled != 0) & (pooled.bfloat16() == 0)).sum()) / pooled.numel(),
    }
    norms = {
        f"param_grad/norm/{m}.{p}": float(getattr(model[m], p).grad.double().norm())
        for m in (0, 2)
        for p in ("weight", "bias")
    }
    return {**norms, **numerics, "activation/mean/0": float(pooled.mean()), "activation/std/0": float(pooled.std())}


def test_ddp_and_fsdp2_on_two_cpu_processes(tmp_path: Path) -> None:
    spawn_ranks(_worker, tmp_path, WORLD, TIMEOUT)
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


def _failures_worker(rank: int, root: str) -> None:
    """Rank 1 feeds NaN, an empty FSDP2 shard, different calls on the ranks, a rank that raises."""
    from torch.distributed.fsdp import fully_shard

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = mlp(6, 12, 3, seed=0)
        for inputs in (False, True):  # input NaN counts (and with inputs=True all statistics) pooled
            where = f"{root}/nan{inputs}"
            # (No DDP: each rank's own gradients, so no parameters; several ranks would need optimizer=.)
            with HookLogger(model, log_dir=where, every=1, reduce_ranks=True, inputs=inputs, parameters=False) as hooks:
                for step in range(2):
                    model(_nan_batch(rank, step)).sum().backward()
                    hooks.step()
                if rank == 0:
                    (finding,) = hooks.findings
                    assert finding.module == "0" and "already in the input of 0" in finding.message, finding

        model = mlp(16, 8, 1, act=None, seed=0)
        for layer in (model[0], model[1], model):
            fully_shard(layer)  # rank 1's shard of model[1]'s weight and bias is empty
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with HookLogger(model, log_dir=f"{root}/empty{rank}", every=1, optimizer=opt, reduce_ranks=True) as hooks:
            train(hooks, _losses(model, rank, inputs=16), opt)
        assert not caught, [str(w.message) for w in caught]

        # Rank 1 calls the model twice in each step: one warning on each rank, and training goes on.
        model = mlp(16, 8, 1, act=None, seed=0)
        with HookLogger(model, log_dir=f"{root}/differ{rank}", every=1, reduce_ranks=True, parameters=False) as hooks:
            for _ in range(2):
                for _ in range(1 + rank):
                    model(torch.randn(4, 16)).sum().backward()
                hooks.step()
        (warning,) = caught
        assert "different calls of the watched modules" in str(warning.message), warning
        caught.clear()

        # Rank 0 cannot write step 0 and stops; at step 1 rank 1 learns it and stops too; no
        # collective after that (step 2 would wait for rank 0 alone).
        where = {"writer": _FailingWriter(f"{root}/broken")} if rank == 0 else {}
        with HookLogger(model, every=1, reduce_ranks=True, parameters=False, **where) as hooks:  # type: ignore[arg-type]
            for _ in range(3):
                model(torch.randn(4, 16)).sum().backward()
                hooks.step()
        for writer in where.values():
            writer.close()  # the logger does not close a writer it was given
        (warning,) = caught
        expected = "writing step 0 to TensorBoard failed" if rank == 0 else "rank(s) [0] stopped logging"
        assert expected in str(warning.message), warning
        caught.clear()

        try:  # a with-block left normally inside an except clause ends its step on every rank
            raise KeyError("handled before the block")
        except KeyError:
            with HookLogger(model, log_dir=f"{root}/handled{rank}", every=1, reduce_ranks=True, parameters=False):
                model(_batch(rank, 0, inputs=16)).sum().backward()

        # Rank 1 raises inside a logged step, rank 0 once rank 1 is out: neither waits in a collective.
        signal = Path(root, "rank1_out")
        if rank == 1:
            hooks = HookLogger(model, log_dir=f"{root}/raise{rank}", every=1, reduce_ranks=True, parameters=False)
            with pytest.raises(ValueError, match="bad batch"), hooks:
                model(torch.randn(4, 16)).sum().backward()
                raise ValueError("bad batch")
            signal.touch()
        else:
            hooks = HookLogger(model, log_dir=f"{root}/raise{rank}", every=1, reduce_ranks=True, parameters=False)
            with pytest.raises(ValueError, match="peer failed"):
                try:
                    model(torch.randn(4, 16)).sum().backward()
                    while not signal.exists():  # a regression makes rank 1 time out first
                        time.sleep(0.01)
                    raise ValueError("peer failed")
                finally:
                    hooks.close()  # a plain close() while the exception propagates
        assert not caught, [str(w.message) for w in caught]


class _FailingWriter(SummaryWriter):
    """A writer whose flush fails, as on a lost network file system."""

    def flush(self) -> None:
        raise OSError(errno.EIO, "Input/output error")


def _nan_batch(rank: int, step: int) -> torch.Tensor:
    x = _batch(rank, step) * (1 + 9 * rank)  # rank 1's inputs spread wider: rank 0's alone differ
    if rank == 1 and step == 0:
        x[0, 0] = float("nan")
    return x


def test_failures_and_pooling_on_two_cpu_processes(tmp_path: Path) -> None:
    spawn_ranks(_failures_worker, tmp_path, WORLD, TIMEOUT)
    for inputs in (False, True):
        run = read_run(tmp_path / f"nan{inputs}")
        assert run.scalar("input/nonfinite/0", 0) == 1  # rank 1's NaN
        assert run.scalar("activation/nonfinite/0", 0) == 12  # its row of the first layer's output
        pooled = torch.cat([_nan_batch(rank, 1) for rank in range(WORLD)]).double()
        if inputs:
            for stat, value in (("mean", pooled.mean()), ("std", pooled.std()), ("max", pooled.max())):
                assert run.scalar(f"input/{stat}/0", 1) == pytest.approx(float(value), rel=1e-5), stat
        else:
            assert not any(tag.startswith("input/mean") for tag in run.scalars)

    reference = mlp(16, 8, 1, act=None, seed=0)
    for rank in range(WORLD):  # FSDP2 averages the gradients of the ranks' batches
        (reference(_batch(rank, 0, inputs=16)).square().mean() / WORLD).backward()
    run = read_run(tmp_path / "empty0")
    for name, p in reference.named_parameters():
        assert run.scalar(f"param_grad/norm/{name}", 0) == pytest.approx(float(p.grad.norm()), rel=1e-5), name
    assert set(run.scalars["param_grad/global_norm"]) == {0, 1}
    assert run.histograms["param_grad/1.bias"][0].num == 1  # rank 0's shard holds the one element

    first_layer = mlp(16, 8, 1, act=None, seed=0)[0]
    pooled = first_layer(torch.cat([_batch(rank, 0, inputs=16) for rank in range(WORLD)])).detach()
    assert read_run(tmp_path / "handled0").scalar("activation/max/0", 0) == pytest.approx(float(pooled.max()))
    assert not read_run(tmp_path / "differ0").scalars  # logging stopped before step 0 was written
