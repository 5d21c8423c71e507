"""torchtitan 0.3.0's own Llama 3 (``tests/titan.py``: its debug config made small, its sharding
configuration, ``parallelize_llama`` with a ``ParallelDims``, FSDP2 always applied), on two CPU
processes with gloo, in float64, under each of its backends at tensor-parallel degree 2: what the
logger writes is what one process writes on the same data."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_run, read_run, read_tensors, spawn_ranks

from tblog_hooks import Histograms, HookLogger
from tblog_hooks.stats.tags import HEADS_TABLE_TAG

pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is installed by scripts/bootstrap (--no-deps)")
pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

import titan  # noqa: E402  (after the skip: it needs torchtitan)

STEPS = 2
OPTIONS: dict[str, object] = {
    "every": 1,
    "modules": ["*"],  # the model, every block, every parent and leaf
    "inputs": True,
    "histograms": Histograms(every_logged=1, weights_every_logged=1),
}
ACTIVATIONS = ("activation/", "input/", "gradient/")
PARAMETERS = ("param_grad/", "param/")


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(titan.VOCAB, (2, titan.SEQ), generator=torch.Generator().manual_seed(step))


def _train(model: torch.nn.Module, log_dir: str, dims: object = None, steps: int = STEPS, **options: object) -> None:
    """``steps`` SGD steps on the mean square of the logits (each rank's share of it under
    tensor parallelism, whose vocabulary pieces add up); the logged steps' forward eagerly
    (``set_stance``, a no-op for a model with no compiled part: docs/sharded.md)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    numel = 2 * titan.SEQ * titan.VOCAB
    with HookLogger(model, log_dir=log_dir, optimizer=opt, **{**OPTIONS, **options}) as hooks:  # type: ignore[arg-type]
        for step in range(steps):
            with titan.spmd_context(dims), torch.compiler.set_stance("force_eager" if hooks.recording else "default"):
                logits = model(titan.inputs(_tokens(step), dims))
                (titan.local(logits).square().sum() / numel).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()


def _backends(rank: int, root: str, backends: tuple[tuple[str, bool], ...], moe: bool = False) -> None:
    for backend, sp in backends:
        model, dims = titan.parallel(backend, 2, tp=2, sp=sp, moe=moe)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _train(model, f"{root}/../{_run(backend, sp)}", dims)
        said = [str(w.message) for w in caught if str(w.message).startswith("tblog_hooks")]
        Path(root, f"../{_run(backend, sp)}_{rank}.said").write_text(repr(sorted(said)))


def _run(backend: str, sp: bool) -> str:
    return backend if sp else f"{backend}_without_sp"


#: Each spawn's backends and whether sequence parallelism is on (torchtitan's FSDP2 rejects a
#: third model's meshes in one process, spmd_types a second). Without sequence parallelism the
#: embedding, the norms and each block's last projections return Replicate outputs too.
BACKENDS = ((("spmd_types", True),), (("partial_dtensor", True), ("full_dtensor", True)), (("partial_dtensor", False),))
#: Every backend, with sequence parallelism.
SEQUENCE_PARALLEL = BACKENDS[:2]


def test_each_torchtitan_backend_at_tp2_logs_what_one_process_logs(tmp_path: Path) -> None:
    for backends in BACKENDS:
        (tmp_path / _run(*backends[0])).mkdir()
        spawn_ranks(functools.partial(_backends, backends=backends), tmp_path / _run(*backends[0]), 2)
    _train(titan.one_process(), str(tmp_path / "one"))
    one = read_run(tmp_path / "one")
    for run in [_run(*b) for backends in BACKENDS for b in backends]:
        # Every module is logged, those whose output is Replicate over the tensor-parallel ranks
        # too (each rank holds a term of their gradient, reduced at the end of the step): nothing said.
        for rank in range(2):
            assert eval((tmp_path / f"{run}_{rank}.said").read_text()) == [], run
        assert_same_run(read_run(tmp_path / run), one, range(STEPS), ACTIVATIONS + PARAMETERS)


INSIDE = ["layers.0.attention.qkv_linear.wqkv", "layers.1.feed_forward.w2"]  # (inside the compiled blocks)


def _compiled(rank: int, root: str) -> None:
    from torch._dynamo.utils import counters

    model, dims = titan.parallel("partial_dtensor", 2, tp=2, compiled=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, root, dims, steps=4, every=2)
    said = [str(w.message) for w in caught if str(w.message).startswith("tblog_hooks")]
    graphs = counters["stats"]["unique_graphs"]
    Path(root, f"{rank}.said").write_text(repr((said, dict(counters["graph_break"]), graphs)))


def test_torchtitan_per_block_compile_at_tp2_whose_logged_steps_run_eagerly_logs_what_one_process_logs(
    tmp_path: Path,
) -> None:
    """torchtitan's per-block compile (``fullgraph=True``) under tensor parallelism, the logged
    steps' forward run eagerly (``set_stance("force_eager")`` while ``hooks.recording``): every
    module, those inside the compiled blocks too, logged as one process logs it, nothing said;
    the other steps run compiled, without a graph break."""
    (tmp_path / "compiled").mkdir()
    spawn_ranks(_compiled, tmp_path / "compiled", 2)
    _train(titan.one_process(), str(tmp_path / "one"), steps=4, every=2)
    one = read_run(tmp_path / "one")
    assert {f"activation/std/{name}" for name in INSIDE} <= set(one.scalars)
    assert_same_run(read_run(tmp_path / "compiled"), one, range(4), ACTIVATIONS + PARAMETERS)
    for rank in range(2):
        said, breaks, graphs = eval((tmp_path / "compiled" / f"{rank}.said").read_text())
        assert said == [] and breaks == {} and graphs > 0, (rank, said, breaks, graphs)


def _batch(replica: int) -> torch.Tensor:
    return torch.randint(titan.VOCAB, (2, titan.SEQ), generator=torch.Generator().manual_seed(replica))


def _forward(model: torch.nn.Module, log_dir: str, tokens: torch.Tensor, dims: object = None) -> None:
    """One logged forward and backward with ``numerics=True`` (``activation/amax_channel``)."""
    with HookLogger(model, log_dir=log_dir, every=1, modules=["*"], numerics=True, parameters=False) as hooks:
        with titan.spmd_context(dims):
            titan.local(model(titan.inputs(tokens, dims))).square().sum().backward()
        hooks.step()


def _full_dtensor_2d(rank: int, root: str) -> None:
    model, dims = titan.parallel("full_dtensor", 4, tp=2)
    _forward(model, root, _batch(rank // 2), dims)  # (the mesh is dp_shard x tp: ranks 0, 1 hold replica 0)


def test_torchtitan_full_dtensor_on_dp2_x_tp2_gives_the_global_channel_index(tmp_path: Path) -> None:
    """Under ``full_dtensor`` on a dp 2 x tp 2 mesh an output is a ``DTensor`` split along the
    batch over the data-parallel ranks and along its features over the tensor-parallel ones:
    ``activation/amax_channel`` is the channel's index in the whole output (one process on
    both replicas' batches), not within the rank's piece."""
    (tmp_path / "four").mkdir()
    spawn_ranks(_full_dtensor_2d, tmp_path / "four", 4)
    _forward(titan.one_process(), str(tmp_path / "one"), torch.cat([_batch(0), _batch(1)]))
    one, run = read_run(tmp_path / "one"), read_run(tmp_path / "four")
    # (not median_abs: pooled as the largest of the pieces' medians, see docs/sharded.md, Limits)
    roots = {t.rsplit("/", 1)[0] + "/" for t in one.scalars if t.startswith("activation/") and "median_abs" not in t}
    assert "activation/amax_channel/" in roots
    assert_same_run(run, one, range(1), tuple(sorted(roots)), histograms=False)


def _moe(rank: int, root: str) -> None:
    _backends(rank, root, (("partial_dtensor", True),), moe=True)


#: From the first block's routed experts on, the numbers are bf16's (torchtitan's grouped experts
#: multiply in bf16, whose roundings differ once their hidden units are split over ranks).
DOWNSTREAM = ("layers.0.moe", "layers.1", "norm", "lm_head", "root")


def test_torchtitan_moe_routed_experts_at_tp2_log_what_one_process_logs(tmp_path: Path) -> None:
    """torchtitan's Qwen3 MoE at tp 2: its routed experts compute each rank's share of their
    hidden units inside a local-tensor region whose result is ``Partial``, so what the inner
    experts return on a rank is a term of a sum over the ranks: copied and reduced at the end
    of the step, their statistics and histograms are one process's (to bf16's precision, as
    everything from the experts on), their inputs and output gradients too; nothing said."""
    (tmp_path / "partial_dtensor").mkdir()
    spawn_ranks(_moe, tmp_path / "partial_dtensor", 2)
    _train(titan.one_process(moe=True), str(tmp_path / "one"))
    one, run = read_run(tmp_path / "one"), read_run(tmp_path / "partial_dtensor")
    for rank in range(2):
        assert eval((tmp_path / f"partial_dtensor_{rank}.said").read_text()) == []
    experts = [f"layers.{i}.moe.routed_experts.inner_experts" for i in range(2)]
    for module in (*experts, "layers.0.moe.routed_experts"):
        tags = [t for t in one.scalars if t.endswith(f"/{module}") and t.startswith(ACTIVATIONS)]
        assert {f"activation/std/{module}", f"input/std/{module}", f"gradient/norm/{module}"} <= set(tags)
        for tag in tags:
            # (the fraction of exact zeros: an element or two of 1024 whose bf16 terms cancel)
            near = 2 / 1024 if "/zero_frac/" in tag else 1e-6
            for step in range(STEPS):
                assert run.scalars[tag][step] == pytest.approx(one.scalars[tag][step], rel=1e-2, abs=near), tag
        for tag in [t for t in one.histograms if t.endswith(f"/{module}")]:
            assert [run.histograms[tag][s].num for s in range(STEPS)] == [
                one.histograms[tag][s].num for s in range(STEPS)
            ]
    for tags in (one.scalars, one.histograms, run.scalars, run.histograms):
        for tag in [t for t in tags if t.rsplit("/", 1)[-1].startswith(DOWNSTREAM)]:
            del tags[tag]
    assert_same_run(run, one, range(1), ("activation/", "input/"))


BLOCKS = ["layers.0", "layers.1"]


def _attention(rank: int, root: str, backends: tuple[tuple[str, bool], ...]) -> None:
    for backend, sp in backends:
        model, dims = titan.parallel(backend, 2, tp=2, sp=sp)
        _train(model, f"{root}/../{backend}", dims, modules=BLOCKS, attention=True)


def test_torchtitan_attention_at_tp2_covers_every_head(tmp_path: Path) -> None:
    """``attention=True`` under each backend at tp 2: torchtitan's inner attention runs on each
    rank's heads (a local-tensor region whose query is handed split along its heads), so the
    per-head statistics of both ranks go side by side and the maxima are of every head: what
    one process writes."""
    for backends in SEQUENCE_PARALLEL:
        (tmp_path / backends[0][0]).mkdir()
        spawn_ranks(functools.partial(_attention, backends=backends), tmp_path / backends[0][0], 2)
    _train(titan.one_process(), str(tmp_path / "one"), modules=BLOCKS, attention=True)
    one, heads = read_run(tmp_path / "one"), read_tensors(tmp_path / "one", HEADS_TABLE_TAG)
    assert sorted(heads) == list(range(STEPS)) and heads[0].shape[1] == titan.HEADS  # (modules x heads x statistics)
    for backend in [b for backends in SEQUENCE_PARALLEL for b, _ in backends]:
        assert_same_run(read_run(tmp_path / backend), one, range(STEPS), ("attention/",), histograms=False)
        theirs = read_tensors(tmp_path / backend, HEADS_TABLE_TAG)
        assert sorted(theirs) == sorted(heads)
        for step, table in heads.items():
            np.testing.assert_allclose(theirs[step], table, rtol=1e-6, err_msg=f"{backend} at step {step}")
