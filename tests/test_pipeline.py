"""Pipeline parallelism (``torch.distributed.pipelining``) on CPU processes with gloo, in float64:
each stage's rank logs its stage's modules as one process with the whole batch logs them (the
microbatches pooled, the output gradients of the whole batch's mean loss, the stage's shape
inference on made-up inputs left out), into a writer of its own, and says once what it cannot
have: the other stages' parameters in its global norm. With ``reduce_ranks=True`` rank 0 alone
writes every stage's modules, and the global norm over them all, as that one process does, on
data-parallel replicas of the pipeline too."""

from __future__ import annotations

import collections
import datetime
import functools
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Run, assert_same_run, read_run, spawn_ranks
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
pipelining = pytest.importorskip("torch.distributed.pipelining")

STEPS, MICROBATCHES = 2, 4
STAGES = (("0", "1"), ("2", "3", "4"))  # the Sequential's children each stage holds, under their names
STAGES_INTERLEAVED = (("0",), ("1", "2"), ("3",), ("4",))
ROOTS = ("activation/", "input/", "gradient/", "param_grad/norm/", "param/")
SCHEDULES = ["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B"]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)


def _stages(rank: int, root: str, schedule: str, merged: bool = False) -> None:
    """Train ``STEPS`` steps as ``rank``'s stages of ``schedule``, logged into a writer of this
    rank's own; ``merged``: with ``reduce_ranks=True``, rank 0 alone writing (into its own)."""
    children = dict(_model().named_children())
    if schedule == "ScheduleInterleaved1F1B":  # (two stages a rank: the first and the third, the second and the fourth)
        held = [STAGES_INTERLEAVED[rank], STAGES_INTERLEAVED[rank + 2]]
        chunks = [nn.Sequential(collections.OrderedDict((n, children[n]) for n in names)) for names in held]
        stages = [pipelining.PipelineStage(c, rank + 2 * i, 4, torch.device("cpu")) for i, c in enumerate(chunks)]
        runs = pipelining.ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=nn.functional.mse_loss)
        part = nn.Sequential(collections.OrderedDict((n, children[n]) for names in held for n in names))
    else:
        part = nn.Sequential(collections.OrderedDict((n, children[n]) for n in STAGES[rank]))
        stage = pipelining.PipelineStage(part, rank, len(STAGES), torch.device("cpu"))
        runs = getattr(pipelining, schedule)(stage, MICROBATCHES, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    writer = None if merged else SummaryWriter(f"{root}/../{schedule}_{rank}")
    options = {"reduce_ranks": True, "log_dir": f"{root}/../{schedule}_{rank}"} if merged else {"writer": writer}
    logger = functools.partial(HookLogger, part, optimizer=opt, every=1, inputs=True, spikes=True, **options)
    _train(runs, opt, logger, Path(root, f"../{schedule}_{rank}.said"), first=rank == 0)
    if writer is not None:
        writer.close()


def _train(
    runs: object,
    opt: torch.optim.Optimizer,
    logger: Callable[[], HookLogger],
    said: Path,
    *,
    first: bool,
    half: int = -1,
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] = _batch,
) -> None:
    """``STEPS`` steps of the schedule ``runs`` on ``batch(step)``'s inputs and targets
    (``first``: this rank's stage takes the inputs, else the targets; ``half``: of each batch,
    that half alone), logged by ``logger()``; the warnings it gives written to ``said``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with logger() as hooks:
            for step in range(STEPS):
                x, y = (t if half < 0 else t.chunk(2)[half] for t in batch(step))
                runs.step(x) if first else runs.step(target=y)  # type: ignore[attr-defined]
                opt.step()
                opt.zero_grad()
                hooks.step()
    said.write_text(repr([str(w.message) for w in caught if str(w.message).startswith("tblog_hooks")]))


def _of(run: Run, modules: tuple[str, ...]) -> Run:
    """``run`` with only the tags of ``modules``."""

    def keep(tags: dict) -> dict:  # type: ignore[type-arg]
        return {t: v for t, v in tags.items() if t.rsplit("/", 1)[-1].split(".")[0] in modules}

    return Run(keep(run.scalars), keep(run.histograms))


def _one_process(root: Path) -> Run:
    """The whole model trained on the whole batches in one process, logged as the stages are."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=str(root), optimizer=opt, every=1, inputs=True, spikes=True) as hooks:
        for step in range(STEPS):
            x, y = _batch(step)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    return read_run(root)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_pipeline_stage_logs_its_modules_as_one_process(tmp_path: Path, schedule: str) -> None:
    (tmp_path / "ranks").mkdir()
    spawn_ranks(functools.partial(_stages, schedule=schedule), tmp_path / "ranks", 2, datetime.timedelta(seconds=60))
    one = _one_process(tmp_path / "one")
    held: tuple[tuple[str, ...], ...] = STAGES
    if schedule == "ScheduleInterleaved1F1B":
        held = tuple((*a, *b) for a, b in zip(STAGES_INTERLEAVED, STAGES_INTERLEAVED[2:]))
    for rank, modules in enumerate(held):
        run = read_run(tmp_path / f"{schedule}_{rank}")
        assert_same_run(_of(run, modules), _of(one, modules), range(STEPS), ROOTS)
        assert _samples(run) == (_samples(one) if rank == 0 and schedule != "ScheduleInterleaved1F1B" else {})
        said = eval((tmp_path / f"{schedule}_{rank}.said").read_text())
        assert len(said) == 1 and "param_grad/global_norm and step/grad_norm are of this stage's" in said[0], said


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_reduce_ranks_writes_every_pipeline_stage_as_one_process(tmp_path: Path, schedule: str) -> None:
    """``reduce_ranks=True``: rank 0 writes every stage's modules (their scalars and histograms)
    and ``param_grad/global_norm`` over every stage's parameters, as one process; rank 1 nothing."""
    (tmp_path / "ranks").mkdir()
    stages = functools.partial(_stages, schedule=schedule, merged=True)
    spawn_ranks(stages, tmp_path / "ranks", 2, datetime.timedelta(seconds=60))
    one = _one_process(tmp_path / "one")
    merged = read_run(tmp_path / f"{schedule}_0")
    assert_same_run(merged, one, range(STEPS), (*ROOTS, "param_grad/global_norm"))
    modules = {t.rsplit("/", 1)[-1].split(".")[0] for t in merged.scalars if t.startswith(ROOTS)}
    assert modules & set(STAGES[0]) and modules & set(STAGES[1]), modules  # (both stages' watched modules)
    assert not (tmp_path / f"{schedule}_1").exists()
    assert _samples(merged) == (_samples(one) if schedule != "ScheduleInterleaved1F1B" else {})
    for rank in range(2):
        said = eval((tmp_path / f"{schedule}_{rank}.said").read_text())
        assert len(said) == 1 and "param_grad/global_norm over every stage's parameters" in said[0], said


def _samples(run: Run) -> dict[int, float]:
    """``step/samples`` by step: the first stage's microbatches, once (the later stages run the
    same samples; the shape inference none). An interleaved schedule calls its stages' chunks,
    not the module the logger was given: nothing is counted, nothing written."""
    return run.scalars.get("step/samples", {})


def _replicated_stages(rank: int, root: str) -> None:
    """Two stages (``Schedule1F1B``) on each of two data-parallel replicas, ``DistributedDataParallel``
    over the ranks of each stage: rank ``stage + 2 * replica``, the replica the half ``replica`` of
    each batch; ``reduce_ranks=True``, rank 0 alone writing."""
    stage, replica = rank % 2, rank // 2
    pipes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    children = dict(_model().named_children())
    part = nn.Sequential(collections.OrderedDict((n, children[n]) for n in STAGES[stage]))
    wrapped = nn.parallel.DistributedDataParallel(part, process_group=replicas[stage])
    piped = pipelining.PipelineStage(wrapped, stage, 2, torch.device("cpu"), group=pipes[replica])
    runs = pipelining.Schedule1F1B(piped, MICROBATCHES, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    logger = functools.partial(
        HookLogger, wrapped, log_dir=f"{root}/../replicated", optimizer=opt, every=1, reduce_ranks=True
    )
    _train(runs, opt, logger, Path(root, f"../replicated_{rank}.said"), first=stage == 0, half=replica)


def test_reduce_ranks_writes_pipeline_stages_over_data_parallel_replicas_as_one_process(tmp_path: Path) -> None:
    """Two stages times two replicas: every scalar of every stage's modules (the replicas' calls
    pooled) and ``param_grad/global_norm`` as one process with the whole batch; histograms (the
    writing rank's batch share's) not compared."""
    (tmp_path / "ranks").mkdir()
    spawn_ranks(_replicated_stages, tmp_path / "ranks", 4, datetime.timedelta(seconds=60))
    one = _one_process(tmp_path / "one")
    roots = ("activation/", "gradient/", "param_grad/norm/", "param/", "param_grad/global_norm")
    assert_same_run(read_run(tmp_path / "replicated"), one, range(STEPS), roots, histograms=False)
    for rank in range(4):
        said = eval((tmp_path / f"replicated_{rank}.said").read_text())
        assert len(said) == 1 and "param_grad/global_norm over every stage's parameters" in said[0], said


def _alike_stages(rank: int, root: str) -> None:
    """Two stages (``ScheduleGPipe``: each stage's calls in the same order) alike in their
    modules' names and shapes (each a Sequential numbered from 0), ``reduce_ranks=True``."""
    torch.manual_seed(rank)
    part = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).double()
    stage = pipelining.PipelineStage(part, rank, 2, torch.device("cpu"))
    runs = pipelining.ScheduleGPipe(stage, MICROBATCHES, loss_fn=lambda out, y: nn.functional.mse_loss(out[:, :4], y))
    opt = torch.optim.SGD(part.parameters(), lr=0.1)
    logger = functools.partial(HookLogger, part, log_dir=f"{root}/../alike", optimizer=opt, every=1, reduce_ranks=True)
    _train(runs, opt, logger, Path(root, f"../alike_{rank}.said"), first=rank == 0)


def test_stages_with_alike_module_names_are_not_pooled_as_replicas(tmp_path: Path) -> None:
    """Stages whose modules have the same names and shapes are not pooled as the calls of one
    module (the replicas of one stage would be): every rank says the ranks' steps cannot be
    combined, and nothing of theirs is written."""
    (tmp_path / "ranks").mkdir()
    spawn_ranks(_alike_stages, tmp_path / "ranks", 2, datetime.timedelta(seconds=60))
    for rank in range(2):
        said = eval((tmp_path / f"alike_{rank}.said").read_text())
        assert any(s.startswith("tblog_hooks: combining step 0 over ranks failed") for s in said), said
    written = read_run(tmp_path / "alike") if (tmp_path / "alike").exists() else None
    assert written is None or not any(t.startswith(("activation/", "gradient/")) for t in written.scalars)


def _titan_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of token sequences and their next tokens, as input and target."""
    import titan

    tokens = torch.randint(titan.VOCAB, (MICROBATCHES, titan.SEQ + 1), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


def _titan_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _titan_stages(rank: int, root: str) -> None:
    """torchtitan's own pipeline: its Llama 3 split into two stages by ``pipeline_llm``, each
    stage under FSDP2 as torchtitan applies it, ``reduce_ranks=True``."""
    import titan

    # (torchtitan's schedules add the microbatches' gradients up, scale_grads=False: each
    # microbatch's loss is its share of the batch's mean, as torchtitan's trainer scales it)
    schedule, stage = titan.pipelined(
        2, MICROBATCHES, lambda logits, targets: _titan_loss(logits, targets) / MICROBATCHES
    )
    opt = torch.optim.SGD(stage.parameters(), lr=0.5)
    logger = functools.partial(HookLogger, stage, log_dir=f"{root}/../titan", optimizer=opt, every=1, reduce_ranks=True)
    _train(schedule, opt, logger, Path(root, f"../titan_{rank}.said"), first=rank == 0, batch=_titan_batch)


def test_torchtitan_pipeline_writes_every_stage_as_one_process(tmp_path: Path) -> None:
    """torchtitan 0.3.0's ``pipeline_llm`` (two stages, ``1F1B``, FSDP2 over a data-parallel mesh
    of one rank in each): rank 0 writes both stages' modules, their histograms and
    ``param_grad/global_norm`` as one process with the whole model and batch."""
    import titan

    (tmp_path / "ranks").mkdir()
    spawn_ranks(_titan_stages, tmp_path / "ranks", 2, datetime.timedelta(seconds=120))
    model = titan.one_process()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with HookLogger(model, log_dir=str(tmp_path / "one"), optimizer=opt, every=1) as hooks:
        for step in range(STEPS):
            tokens, targets = _titan_batch(step)
            _titan_loss(model(tokens), targets).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    one, run = read_run(tmp_path / "one"), read_run(tmp_path / "titan")
    assert {"activation/std/tok_embeddings", "activation/std/lm_head"} <= set(run.scalars)  # (each stage's)
    assert_same_run(run, one, range(STEPS), ("activation/", "gradient/", "param_grad/", "param/"))
