"""torchtitan 0.3.0's own Llama 3 (``tests/titan.py``: its debug config made small, its sharding
configuration, ``parallelize_llama`` with a ``ParallelDims``, FSDP2 always applied), on two CPU
processes with gloo, in float64, under each of its backends at tensor-parallel degree 2: what the
logger writes is what one process writes on the same data."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_run, read_run, spawn_ranks

from tblog_hooks import Histograms, HookLogger

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


def _train(model: torch.nn.Module, log_dir: str, dims: object = None, **options: object) -> None:
    """``STEPS`` SGD steps on the mean square of the logits (each rank's share of it under
    tensor parallelism, whose vocabulary pieces add up)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    numel = 2 * titan.SEQ * titan.VOCAB
    with HookLogger(model, log_dir=log_dir, optimizer=opt, **{**OPTIONS, **options}) as hooks:  # type: ignore[arg-type]
        for step in range(STEPS):
            with titan.spmd_context(dims):
                logits = model(titan.inputs(_tokens(step), dims))
                (titan.local(logits).square().sum() / numel).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()


def _backends(rank: int, root: str, backends: tuple[tuple[str, bool], ...]) -> None:
    for backend, sp in backends:
        model, dims = titan.parallel(backend, 2, tp=2, sp=sp)
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
