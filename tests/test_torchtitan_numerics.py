"""``numerics=`` of parameter gradients under FSDP2, as torchtitan 0.3.0 always shards them
(``tests/titan.py``: its debug Llama 3 made small, ``parallelize_llama``, dp 2 on two CPU processes
with gloo, in float64): each rank measures its shard of each gradient and the shards' counts,
extremes and sums are pooled, so the figures are those of one process on the same data."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_run, read_run, spawn_ranks
from models import mlp

from tblog_hooks import HookLogger

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is installed by scripts/bootstrap (--no-deps)")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

import titan  # noqa: E402  (after the skip: it needs torchtitan)

STEPS = 2


def _tokens(step: int, replica: int) -> torch.Tensor:
    return torch.randint(titan.VOCAB, (2, titan.SEQ), generator=torch.Generator().manual_seed(10 * step + replica))


def _train(model: torch.nn.Module, log_dir: str, replicas: list[int], dims: object = None, **options: object) -> None:
    """``STEPS`` SGD steps on the square of the logits of the batches of ``replicas``, summed and
    divided by the elements of both replicas' (as torchtitan normalises a loss by the global
    token count: its FSDP2 sums the ranks' gradients)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with HookLogger(
        model, log_dir=log_dir, optimizer=opt, every=1, numerics=True, histograms=False, **options
    ) as hooks:  # type: ignore[arg-type]
        for step in range(STEPS):
            with titan.spmd_context(dims):
                tokens = torch.cat([_tokens(step, r) for r in replicas])
                (
                    titan.local(model(titan.inputs(tokens, dims))).square().sum() / (4 * titan.SEQ * titan.VOCAB)
                ).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()


def _small(rank: int) -> list[torch.Tensor]:
    return [torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + rank)) for step in range(STEPS)]


def _train_small(model: torch.nn.Module, log_dir: str, replicas: list[int], **options: object) -> None:
    """The same on a 16-8-1 MLP, whose last weight FSDP2 shards as one row and none, on the mean
    loss (FSDP2's own averages the ranks' gradients)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with HookLogger(
        model, log_dir=log_dir, optimizer=opt, every=1, numerics=True, histograms=False, **options
    ) as hooks:  # type: ignore[arg-type]
        for step in range(STEPS):
            model(torch.cat([_small(r)[step] for r in replicas])).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()


def _fsdp(rank: int, root: str, reduce_ranks: bool) -> None:
    from torch.distributed.fsdp import fully_shard

    model, dims = titan.parallel("spmd_types", 2, tp=1)
    _train(model, f"{root}/titan", [rank], dims, reduce_ranks=reduce_ranks)
    small = mlp(16, 8, 1, act=None, seed=0)
    for layer in (small[0], small[1], small):
        fully_shard(layer)
    _train_small(small, f"{root}/small", [rank], reduce_ranks=reduce_ranks)


@pytest.mark.parametrize("reduce_ranks", [False, True])
def test_parameter_gradient_numerics_of_fsdp2_shards_are_one_process(tmp_path: Path, reduce_ranks: bool) -> None:
    (tmp_path / "fsdp").mkdir()
    spawn_ranks(functools.partial(_fsdp, reduce_ranks=reduce_ranks), tmp_path / "fsdp", 2)
    _train(titan.one_process(), str(tmp_path / "one"), [0, 1])
    _train_small(mlp(16, 8, 1, act=None, seed=0), str(tmp_path / "small"), [0, 1])
    for one, run in (("one", "fsdp/titan"), ("small", "fsdp/small")):
        one, run = read_run(tmp_path / one), read_run(tmp_path / run)
        assert any(t.startswith("param_grad/") and "/norm/" not in t for t in one.scalars)  # (numerics tags)
        assert_same_run(run, one, range(STEPS), ("param_grad/",), histograms=False)
