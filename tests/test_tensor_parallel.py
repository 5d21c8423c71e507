"""Tensor parallelism (``parallelize_module``), alone on two CPU processes and under FSDP2 on a 2-D
mesh of four, with gloo: every logged scalar and histogram is the one a single process gives on
the same data (activations and output gradients of the writing rank's batch, or of every batch
with ``reduce_ranks=True``; parameter gradients averaged over the data-parallel ranks)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_run, read_images, read_run, spawn_ranks
from models import mlp
from torch import nn

from tblog_hooks import Histograms, HookLogger

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS = 2
WATCHED = ["0", "1", "2", "3", "4"]  # the ReLUs too: their inputs and outputs are pieces after layer 0
OPTIONS: dict[str, object] = {
    "every": 1,
    "modules": WATCHED,
    "inputs": True,
    "histograms": Histograms(every_logged=1, weights_every_logged=1),
    "spikes": True,  # every step's gradient norm (step/grad_norm), summed over the pieces at each step
}


def _model() -> nn.Sequential:
    return mlp(16, 32, 32, 8, act=nn.ReLU, seed=0)


def _batch(replica: int, step: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + replica))


def _plan() -> dict[str, object]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _train(model: nn.Module, log_dir: str, batches: Callable[[int], list[torch.Tensor]], **options: object) -> None:
    """``STEPS`` SGD steps, each the mean of the losses of ``batches(step)``."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=log_dir, optimizer=opt, **{**OPTIONS, **options}) as hooks:  # type: ignore[arg-type]
        for step in range(STEPS):
            xs = batches(step)
            (sum(model(x).square().mean() for x in xs) / len(xs)).backward()  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            hooks.step()


def _tensor_parallel(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    for name, watched in (("tp", WATCHED), ("relu", ["1"])):  # ["1"]: the pieces' ReLU alone
        model = parallelize_module(_model(), init_device_mesh("cpu", (2,)), _plan())
        _train(model, f"{root}/{name}", lambda step: [_batch(0, step)], modules=watched)


def _fsdp_and_tensor_parallel(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    replica = mesh.get_local_rank("dp")
    for reduce in (False, True):
        model = parallelize_module(_model(), mesh["tp"], _plan())
        for layer in (model[0], model[2], model[4], model):
            fully_shard(layer, mesh=mesh["dp"])
        _train(model, f"{root}/2d_{reduce}", lambda step: [_batch(replica, step)], reduce_ranks=reduce)


ACTIVATIONS = ("activation/", "input/", "gradient/", "gradient_log10/")
PARAMETERS = ("param_grad/", "param/", "step/grad_norm")


def test_tensor_parallel_logs_what_one_process_logs(tmp_path: Path) -> None:
    spawn_ranks(_tensor_parallel, tmp_path, 2)
    _train(_model(), str(tmp_path / "one"), lambda step: [_batch(0, step)])
    run = read_run(tmp_path / "tp")
    assert "step/grad_norm" in run.scalars and "activation/dead_frac/1" in run.scalars
    assert_same_run(run, read_run(tmp_path / "one"), range(STEPS), ACTIVATIONS + PARAMETERS)
    _train(_model(), str(tmp_path / "one_relu"), lambda step: [_batch(0, step)], modules=["1"])
    assert_same_run(read_run(tmp_path / "relu"), read_run(tmp_path / "one_relu"), range(STEPS), ACTIVATIONS)


def test_fsdp2_with_tensor_parallel_on_a_2d_mesh(tmp_path: Path) -> None:
    spawn_ranks(_fsdp_and_tensor_parallel, tmp_path, 4)
    both = read_run(_one_process(tmp_path / "both", lambda step: [_batch(0, step), _batch(1, step)]))
    first = read_run(_one_process(tmp_path / "first", lambda step: [_batch(0, step)]))
    own, pooled = read_run(tmp_path / "2d_False"), read_run(tmp_path / "2d_True")
    # Parameters: the gradient averaged over both data-parallel replicas, as one process on both batches.
    for run in (own, pooled):
        assert_same_run(run, both, range(STEPS), PARAMETERS)
    # Activations: the writing rank's batch; with reduce_ranks=True the scalars pool both (histograms
    # stay the writing rank's). Output gradients are those of the averaged loss (each replica's own,
    # of its own loss, divided by FSDP2's 2): half those of one process on the first batch alone.
    assert_same_run(own, first, range(1), ACTIVATIONS, gradients=0.5)
    assert_same_run(pooled, both, range(STEPS), ACTIVATIONS, histograms=False)


def _one_process(log_dir: Path, batches: Callable[[int], list[torch.Tensor]]) -> Path:
    _train(_model(), str(log_dir), batches)
    return log_dir


def _norm_model() -> nn.Sequential:
    """In float64: the backward of a LayerNorm cancels, so float32 rounding would show through
    the reordered sums of tensor parallelism (2e-4 of the largest gradient here)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16)).double()


def _sequence(step: int) -> torch.Tensor:
    return torch.randn(4, 6, 16, generator=torch.Generator().manual_seed(step), dtype=torch.float64)


def _train_sequence(
    model: nn.Module, log_dir: str, piece: Callable[[torch.Tensor], torch.Tensor], modules: list[str] = WATCHED[:4]
) -> None:
    """``STEPS`` SGD steps on ``piece`` of each step's sequence batch, summed squares as the loss."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    options = {**OPTIONS, "modules": modules}
    with HookLogger(model, log_dir=log_dir, optimizer=opt, **options) as hooks:  # type: ignore[arg-type]
        for step in range(STEPS):
            out = model(piece(_sequence(step)))
            (out.to_local() if hasattr(out, "to_local") else out).square().sum().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()


def _sequence_parallel(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        "0": ColwiseParallel(input_layouts=Shard(1)),
        "2": RowwiseParallel(output_layouts=Shard(1)),
        "3": SequenceParallel(),  # its gradients are placed Partial: summed over the ranks once the step ends
    }
    for watched in (WATCHED[:4], ["3"]):  # ["3"]: only gradients placed Partial
        model = parallelize_module(_norm_model(), init_device_mesh("cpu", (2,)), plan)
        _train_sequence(model, f"{root}/sp{len(watched)}", lambda x: x[:, 3 * rank : 3 * rank + 3], watched)


def test_sequence_parallel_logs_what_one_process_logs(tmp_path: Path) -> None:
    """Each rank holds half of the sequence around the tensor-parallel layers."""
    spawn_ranks(_sequence_parallel, tmp_path, 2)
    # (step/grad_norm leaves the norm's gradients out, placed Partial: said once, see docs/spikes.md)
    roots = (*ACTIVATIONS, "param_grad/", "param/")
    for watched in (WATCHED[:4], ["3"]):
        _train_sequence(_norm_model(), str(tmp_path / f"one{len(watched)}"), lambda x: x, watched)
        run, one = read_run(tmp_path / f"sp{len(watched)}"), read_run(tmp_path / f"one{len(watched)}")
        assert_same_run(run, one, range(STEPS), roots)


def _vocabulary_parallel(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    plan = {**_plan(), "4": ColwiseParallel()}  # (the last layer's output: each rank's share of the "vocabulary")
    model = parallelize_module(_model(), init_device_mesh("cpu", (2,)), plan)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, f"{root}/tp", lambda step: [_batch(0, step)], logits=True, spikes=False)
    said = [str(w.message) for w in caught if "tblog_hooks" in str(w.message)]
    (Path(root) / f"said_{rank}").write_text(repr(said))


def test_logits_of_a_vocabulary_split_over_ranks_are_said_once_and_not_measured(tmp_path: Path) -> None:
    """``logits=`` on an output split over tensor-parallel ranks: no piece tells a token's
    log-partition, so every rank says so once and nothing of it is written; the rest is logged."""
    spawn_ranks(_vocabulary_parallel, tmp_path, 2)
    for rank in range(2):
        said = eval((tmp_path / f"said_{rank}").read_text())
        assert len(said) == 1 and "logits= (the log-partition)" in said[0] and "'4'" in said[0], said
    tags = read_run(tmp_path / "tp").scalars
    assert not [t for t in tags if "log_z" in t or "z_loss" in t]
    assert "activation/std/4" in tags


def _sharded_after_attaching(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    for shard in ("fsdp", "tp"):
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hooks = HookLogger(model, log_dir=f"{root}/{shard}", every=1, optimizer=opt)
            if shard == "fsdp":
                fully_shard(model)
            else:
                parallelize_module(model, init_device_mesh("cpu", (2,)), _plan())
            opt = torch.optim.SGD(model.parameters(), lr=0.1)  # (over the sharded parameters)
            for step in range(STEPS):
                model(_batch(rank, step)).square().mean().backward()
                opt.step()
                hooks.step()
            hooks.close()
        said = [str(w.message) for w in caught if "tblog_hooks" in str(w.message)]
        if rank == 0:  # (the writing rank; the other records nothing)
            assert any("create the HookLogger after sharding the model" in warning for warning in said), said


def test_a_model_sharded_after_attaching_is_not_logged(tmp_path: Path) -> None:
    """Attach after ``fully_shard`` / ``parallelize_module``: attached before, the writing rank says
    so at the end of the first logged step, and writes nothing rather than its own pieces."""
    spawn_ranks(_sharded_after_attaching, tmp_path, 2)
    for shard in ("fsdp", "tp"):
        assert not [t for t in read_run(tmp_path / shard).scalars if t.startswith("param_grad/")], shard


class _Attention(nn.Module):
    """Causal self-attention over 4 heads of 4; under tensor parallelism each rank has 2 of them."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.q, self.k, self.v, self.o = (nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (f(x).unflatten(-1, (-1, 4)).transpose(1, 2) for f in (self.q, self.k, self.v))  # this rank's heads
        return self.o(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def _train_attention(model: nn.Module, log_dir: str) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=log_dir, every=1, optimizer=opt, attention=True) as hooks:
        for step in range(STEPS):
            model(_sequence(step).float()).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()


def _parallel_attention(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
    _train_attention(parallelize_module(_Attention(), init_device_mesh("cpu", (2,)), plan), f"{root}/attention")


def test_attention_heads_split_over_ranks_are_those_of_one_process(tmp_path: Path) -> None:
    spawn_ranks(_parallel_attention, tmp_path, 2)
    _train_attention(_Attention(), str(tmp_path / "one"))
    run, one = read_run(tmp_path / "attention"), read_run(tmp_path / "one")
    assert_same_run(run, one, range(STEPS), ("attention/",), histograms=False)
    for picture in ("health/attention_max_logit", "health/attention_entropy"):  # every head, in order
        ours, theirs = read_images(tmp_path / "attention", picture), read_images(tmp_path / "one", picture)
        for step in range(STEPS):
            assert np.abs(ours[step].astype(int) - theirs[step].astype(int)).max() <= 1, (picture, step)


def _object_collectives(rank: int, root: str) -> None:
    """Per logged step, the ``all_gather_object`` calls (each a host sync under NCCL alone) of a
    tensor-parallel model without histograms, with them, and of a norm whose gradients are
    placed ``Partial`` (docs/sharded.md, Cost)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    calls: list[int] = []
    real = dist.all_gather_object

    def counting(*args: object, **kwargs: object) -> None:
        calls.append(1)
        real(*args, **kwargs)  # type: ignore[arg-type]

    dist.all_gather_object = counting  # type: ignore[assignment]  # (this process only)
    histograms = Histograms(every_logged=1, weights_every_logged=1)
    sequence = {
        "0": ColwiseParallel(input_layouts=Shard(1)),
        "2": RowwiseParallel(output_layouts=Shard(1)),
        "3": SequenceParallel(),
    }
    cases = [(_model, _plan(), ["0", "1", "2"], False), (_model, _plan(), ["0", "1", "2"], histograms)]
    cases.append((_norm_model, sequence, ["3"], histograms))
    counts = []
    for build, plan, modules, hist in cases:
        model = parallelize_module(build(), init_device_mesh("cpu", (2,)), plan)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        with HookLogger(
            model, log_dir=f"{root}/count", every=1, modules=modules, optimizer=opt, histograms=hist
        ) as hooks:
            x = _sequence(0)[:, 3 * rank : 3 * rank + 3] if build is _norm_model else _batch(0, 0)
            out = model(x)
            (out.to_local() if hasattr(out, "to_local") else out).square().sum().backward()
            opt.step()
            calls.clear()
            hooks.step()
            counts.append(len(calls))
    if rank == 0:
        Path(root, "counts").write_text(repr(counts))


def test_a_logged_step_makes_one_to_three_object_collectives(tmp_path: Path) -> None:
    spawn_ranks(_object_collectives, tmp_path, 2)
    # One description of what each rank recorded; again once the Partial gradients are reduced;
    # and, where pieces' histogram samples are binned together, whether packing failed anywhere.
    assert (tmp_path / "counts").read_text() == "[1, 2, 3]"
