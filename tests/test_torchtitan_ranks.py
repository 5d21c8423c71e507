"""torchtitan 0.3.0's own Llama 3 (``tests/titan.py``) on CPU processes with gloo, in float64,
where what the ranks do together matters: a logger made before ``parallelize_llama`` (as a
torchtitan model is built, then sharded) makes no collective another rank skips, and training goes
on; under FSDP2 with torchtitan's ``OptimizersContainer`` and ``reduce_ranks=True``,
``step/grad_norm`` counts each gradient once and ``step/loss`` is the global loss, as one process
has them; at dp 2 x tp 2 with ``reduce_ranks=True`` every value replicated over the tensor-parallel
ranks counts once."""

from __future__ import annotations

import datetime
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_run, read_run, spawn_ranks

from tblog_hooks import HookLogger

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is installed by scripts/bootstrap (--no-deps)")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

import titan  # noqa: E402  (after the skip: it needs torchtitan)

STEPS = 3
#: Each rank's batch (two sequences); one process takes both.
BATCH = 2
NUMEL = 2 * BATCH * titan.SEQ * titan.VOCAB  # the logits of both ranks' batches


def _tokens(step: int) -> torch.Tensor:
    """Both ranks' batches of step ``step``, rank 0's first."""
    return torch.randint(titan.VOCAB, (2 * BATCH, titan.SEQ), generator=torch.Generator().manual_seed(step))


def _container(model: torch.nn.Module) -> torch.optim.Optimizer:
    """torchtitan's ``OptimizersContainer`` of one AdamW (itself an optimizer, stepping the one it holds)."""
    from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

    group = ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
    config = OptimizersContainer.Config(param_groups=[group], implementation="for-loop")
    return OptimizersContainer(config, model_parts=[model])


def _train(model: torch.nn.Module, hooks: HookLogger, opt: torch.optim.Optimizer, rows: slice) -> None:
    """``STEPS`` steps on the sum of the squared logits of the batch's ``rows`` over those of the
    whole batch (torchtitan's loss: each rank's share of the global one, gradients summed over ranks)."""
    with hooks:
        for step in range(STEPS):
            loss = model(_tokens(step)[rows]).square().sum() / NUMEL
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)


def _ranks(rank: int, root: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made: list[HookLogger] = []
        options = {"every": 1, "spikes": True, "parameters": False}

        def attach(model: torch.nn.Module) -> None:
            made.append(HookLogger(model, log_dir=f"{root}/../late", **options))  # type: ignore[arg-type]

        model, _ = titan.parallel("partial_dtensor", 2, tp=1, before=attach)
        _train(model, made[0], torch.optim.SGD(model.parameters(), lr=0.5), slice(None))
    said = [str(w.message) for w in caught if str(w.message).startswith("tblog_hooks")]
    Path(root, f"../late_{rank}.said").write_text(repr(said))
    model, _ = titan.parallel("partial_dtensor", 2, tp=1)
    opt = _container(model)
    hooks = HookLogger(model, log_dir=f"{root}/../fsdp", optimizer=opt, every=STEPS, spikes=True, reduce_ranks=True)
    _train(model, hooks, opt, slice(rank * BATCH, (rank + 1) * BATCH))


def test_torchtitan_logger_made_before_sharding_and_its_optimizers_container(tmp_path: Path) -> None:
    (tmp_path / "ranks").mkdir()
    spawn_ranks(_ranks, tmp_path / "ranks", 2, timeout=datetime.timedelta(seconds=60))
    # Made before parallelize_llama: the per-step norms stop on the rank that reads them (rank 0,
    # which writes) before any collective, its logging at the first logged step (rank 1 neither
    # writes nor joins a collective: off from the start, silent); training goes on.
    said = [eval((tmp_path / f"late_{rank}.said").read_text()) for rank in range(2)]
    assert [sum("create the HookLogger after sharding" in w for w in s) for s in said] == [2, 0], said
    assert not [t for t in read_run(tmp_path / "late").scalars if not t.startswith("step/")]
    # FSDP2 with the container: one process's norm and loss at every step (one process with a
    # plain AdamW: the container is an optimizer that steps the one it holds).
    model = titan.one_process()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    one_logger = HookLogger(model, log_dir=str(tmp_path / "one"), optimizer=opt, every=STEPS, spikes=True)
    _train(model, one_logger, opt, slice(None))
    run, one = read_run(tmp_path / "fsdp").scalars, read_run(tmp_path / "one").scalars
    for tag in ("step/grad_norm", "step/loss", "step/samples"):
        assert sorted(run[tag]) == sorted(one[tag]) == list(range(STEPS)), tag
        for step in range(STEPS):
            assert run[tag][step] == pytest.approx(one[tag][step], rel=1e-9), (tag, step)
    # The container's step moves each parameter once: its update ratio is one process's.
    ratios = sorted(t for t in one if t.startswith("param/update_ratio/"))
    assert ratios and sorted(t for t in run if t.startswith("param/update_ratio/")) == ratios
    for tag in ratios:
        assert run[tag][0] == pytest.approx(one[tag][0], rel=1e-6), tag


#: What dp 2 x tp 2 runs watch and compare (the final norm's output is Replicate: its gradient is
#: placed Partial, reduced at the end of the step).
OPTIONS: dict[str, object] = {
    "every": 1,
    "modules": ["*"],
    "inputs": True,
    "reduce_ranks": True,  # (the scalars: histograms are the writing rank's own)
    "spikes": True,  # (step/samples: the step's batch, each replica's once)
}
ROOTS = ("activation/", "input/", "gradient/", "param_grad/", "param/", "step/")


def _pooled(model: torch.nn.Module, log_dir: str, dims: object, rows: slice | None) -> None:
    """Two SGD steps on the mean square of the logits over the whole batch: each rank's share of
    it (its replica's rows, its vocabulary piece: a term of the loss), or under ``full_dtensor``
    the loss of the whole batch as a ``DTensor`` (``step(loss=...)`` given either); one process
    (``dims`` ``None``) takes each replica's rows in a call of its own (``rows`` ``None``) or all
    of them in one."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    whole = dims is not None and dims.spmd_backend == "full_dtensor"  # type: ignore[attr-defined]
    with HookLogger(model, log_dir=log_dir, optimizer=opt, **OPTIONS) as hooks:  # type: ignore[arg-type]
        for step in range(2):
            tokens = _tokens(step)
            batches = [tokens[rows]] if rows is not None else [tokens[:BATCH], tokens[BATCH:]]
            with titan.spmd_context(dims):
                outputs = [model(titan.inputs(b, dims)) for b in batches]
                loss = sum((o if whole else titan.local(o)).square().sum() for o in outputs) / NUMEL
                loss.backward()  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)  # type: ignore[arg-type]


def _dp2_tp2(rank: int, root: str) -> None:
    for backend in ("partial_dtensor", "full_dtensor"):
        model, dims = titan.parallel(backend, 4, tp=2)
        replica = dims.get_mesh("batch").get_local_rank()
        _pooled(model, f"{root}/../{backend}", dims, slice(replica * BATCH, (replica + 1) * BATCH))


def test_torchtitan_dp2_tp2_reduce_ranks_counts_each_replicated_value_once(tmp_path: Path) -> None:
    """``step/loss`` too: the terms each rank's vocabulary piece gives (``partial_dtensor``) are
    summed over every rank, the whole batch's ``DTensor`` loss (``full_dtensor``) counted once."""
    (tmp_path / "ranks").mkdir()
    spawn_ranks(_dp2_tp2, tmp_path / "ranks", 4, timeout=datetime.timedelta(seconds=120))
    # Every rank's calls pooled, each value once: the two replicas' batches as two calls of one
    # process (partial_dtensor), as the pieces of one batch (full_dtensor: one call of both).
    _pooled(titan.one_process(), str(tmp_path / "calls"), None, None)
    _pooled(titan.one_process(), str(tmp_path / "batch"), None, slice(None))
    for backend, one in (("partial_dtensor", "calls"), ("full_dtensor", "batch")):
        assert_same_run(read_run(tmp_path / backend), read_run(tmp_path / one), range(2), ROOTS, histograms=False)
