"""A Llama sharded as torchtitan's ``parallelize_llama`` shards it (``models.parallelize_llama``:
sequence-parallel norms, ``PrepareModuleInput`` parents, a ``RowwiseParallel`` embedding, a
``ColwiseParallel`` output with and without loss parallelism), on CPU processes with gloo, in
float64: every scalar and histogram (and with ``attention=True`` every head's attention
statistics) is the one a single process gives on the same data, whichever modules are watched,
at TP 2, TP 4 and under FSDP2 on a dp 2 x tp 2 mesh (with torchtitan's activation checkpointing:
tags named as the model's modules, without the wrapper's attribute)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import Run, assert_same_run, read_run, spawn_ranks
from models import Llama, parallelize_llama
from torch import nn

from tblog_hooks import Histograms, HookLogger

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS = 2
VOCAB = 32
EVERYTHING = ["*"]  # the model, every block, every parent and leaf
BLOCKS = ["layers.0", "layers.1"]  # the blocks alone (the embedding that makes their sequence pieces unwatched)
OPTIONS: dict[str, object] = {
    "every": 1,
    "inputs": True,
    "histograms": Histograms(every_logged=1, weights_every_logged=1),
    "spikes": True,
}
# (not gradient_log10/: the gradient of the first query under a causal mask is zero in one process
# and of the order of 1e-20 in another order of sums, so the zeros its histogram leaves out differ)
ACTIVATIONS = ("activation/", "input/", "gradient/")
# (step/grad_norm leaves the sequence-parallel norms' gradients out, placed Partial: said once, see docs/spikes.md)
PARAMETERS = ("param_grad/", "param/", "step/loss")


def _tokens(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10 * step + replica)
    return torch.randint(VOCAB, (2, 8), generator=g), torch.randint(VOCAB, (2, 8), generator=g)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(
    model: nn.Module,
    log_dir: str,
    modules: list[str],
    replicas: list[int],
    *,
    loss_parallel: bool = False,
    **options: object,
) -> None:
    """``STEPS`` SGD steps on the mean loss over the batches of ``replicas``; ``step(loss=...)``."""
    from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    config = {**OPTIONS, **options}
    with HookLogger(model, log_dir=log_dir, optimizer=opt, modules=modules, **config) as hooks:  # type: ignore[arg-type]
        for step in range(STEPS):
            with parallel_loss() if loss_parallel else contextlib.nullcontext():
                losses = [_loss(model(tokens), targets) for tokens, targets in map(_tokens, replicas, [step] * 9)]
                loss = sum(losses) / len(losses)
                loss.backward()  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)  # type: ignore[arg-type]


def _tensor_parallel(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    _train(parallelize_llama(Llama(), mesh), f"{root}/tp2_all", EVERYTHING, [0])
    _train(parallelize_llama(Llama(), mesh), f"{root}/tp2_blocks", BLOCKS, [0], attention=True)
    lp = parallelize_llama(Llama(), mesh, loss_parallel=True)
    _train(lp, f"{root}/loss_parallel", EVERYTHING, [0], loss_parallel=True)
    _train(_parallel_embedding(mesh), f"{root}/embedding", ["0", "1"], [0], reduce_ranks=True)


def _compiled_after(rank: int, root: str) -> None:
    """The whole tensor-parallel model compiled after the logger was made, as torchtitan compiles
    (``fullgraph=False``), and with ``fullgraph=True``; each rank's warnings kept."""
    import warnings

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    for fullgraph in (False, True):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = parallelize_llama(Llama(), mesh)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            with HookLogger(model, log_dir=f"{root}/compiled_{fullgraph}", optimizer=opt, every=1) as hooks:
                compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
                for step in range(STEPS):
                    _loss(compiled(_tokens(0, step)[0]), _tokens(0, step)[1]).backward()
                    opt.step()
                    opt.zero_grad()
                    hooks.step()
        said = [str(w.message) for w in caught if str(w.message).startswith("tblog_hooks")]
        Path(root, f"compiled_{fullgraph}_{rank}.said").write_text(repr(said))


def test_a_tensor_parallel_model_compiled_after_the_logger_is_said_never_logged_as_pieces(tmp_path: Path) -> None:
    """Compiled after the logger (whole model, ``fullgraph`` either way), its logged steps run
    compiled: a tensor-parallel model's hooks run in compiled code, where one rank's pieces look
    whole. Every watched module is said once, on each rank, naming the recipe that logs it (below),
    and none of its activation or gradient statistics is written; the parameters are one process's
    (they are read outside compiled code), and training goes on."""
    spawn_ranks(_compiled_after, tmp_path, 2)
    one_dir = tmp_path / "one"
    model = Llama()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with HookLogger(model, log_dir=str(one_dir), optimizer=opt, every=1) as hooks:
        for step in range(STEPS):
            _loss(model(_tokens(0, step)[0]), _tokens(0, step)[1]).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    one = read_run(one_dir)
    for fullgraph in (False, True):
        run = read_run(tmp_path / f"compiled_{fullgraph}")
        assert not [t for t in [*run.scalars, *run.histograms] if t.startswith(ACTIVATIONS)], fullgraph
        assert_same_run(run, one, range(STEPS), ("param_grad/", "param/"))
        for rank in range(2):
            said = eval((tmp_path / f"compiled_{fullgraph}_{rank}.said").read_text())
            compiled = [w for w in said if "in code torch.compile compiled, in a tensor-parallel model" in w]
            assert all("set_stance('force_eager' if hooks.recording else 'default')" in w for w in compiled), said
            assert compiled and len(compiled) == len(set(compiled)), said
            named = {w.split("'")[1] for w in compiled}
            assert named >= {"tok_embeddings", "layers.0.attention.wq", "layers.1.attention.wv"}, said


EAGERLY_LOGGED = 4  # steps, every second one logged: the others run compiled


def _train_compiled(
    model: nn.Module, log_dir: str, compile: Callable[[nn.Module], nn.Module] | None = None, *, eagerly: bool = True
) -> None:
    """The model (``compile``d after the logger was made, or of compiled blocks) run compiled,
    but for the logged steps' forward, run eagerly with ``eagerly`` (``hooks.recording``): the
    recipe of docs/sharded.md."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with HookLogger(model, log_dir=log_dir, optimizer=opt, every=2, inputs=True) as hooks:
        run = model if compile is None else compile(model)
        for step in range(EAGERLY_LOGGED):
            tokens, targets = _tokens(0, step)
            with torch.compiler.set_stance("force_eager" if eagerly and hooks.recording else "default"):
                loss = _loss(run(tokens), targets)
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step()


def _compiled_logged_eagerly(rank: int, root: str) -> None:
    """A tensor-parallel Llama compiled whole after the logger (``fullgraph`` either way), and
    each of its blocks compiled before it as torchtitan compiles them (and so, its logged steps
    run compiled); each rank's warnings, graph breaks and graphs kept."""
    import warnings

    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    for run in ("whole", "whole_fullgraph", "per_block", "per_block_logged_compiled"):
        model = parallelize_llama(Llama(), mesh)
        compile = functools.partial(torch.compile, backend="eager", fullgraph=run != "whole")
        if run.startswith("per_block"):
            for key, block in model.layers.items():
                model.layers[key] = compile(block)
        torch._dynamo.reset()  # (each run compiles its own graphs)
        counters.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eagerly = run != "per_block_logged_compiled"
            _train_compiled(model, f"{root}/{run}", compile if run.startswith("whole") else None, eagerly=eagerly)
        said = [str(w.message) for w in caught if str(w.message).startswith("tblog_hooks")]
        breaks = dict(counters["graph_break"])
        Path(root, f"{run}_{rank}.said").write_text(repr((said, breaks, counters["stats"]["unique_graphs"])))


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance: torch 2.6 and later")
def test_a_compiled_tensor_parallel_model_whose_logged_steps_run_eagerly_logs_what_one_process_logs(
    tmp_path: Path,
) -> None:
    """Compiled whole after the logger (``fullgraph`` either way) or block by block before it,
    a tensor-parallel model whose logged steps run eagerly (``set_stance("force_eager")`` while
    ``hooks.recording``) logs every module as one process does, nothing said; the other steps
    run compiled, without a graph break. Its logged steps compiled, the modules inside the
    compiled blocks are said once each, naming the recipe, and left out; the others are logged."""
    spawn_ranks(_compiled_logged_eagerly, tmp_path, 2)
    _train_compiled(Llama(), str(tmp_path / "one"))
    one = read_run(tmp_path / "one")
    inside = {"activation/std/layers.0.attention.wq", "activation/std/layers.1.feed_forward.w2"}
    assert inside <= set(one.scalars)
    for run in ("whole", "whole_fullgraph", "per_block"):
        assert_same_run(read_run(tmp_path / run), one, range(EAGERLY_LOGGED), ACTIVATIONS + PARAMETERS)
        for rank in range(2):
            said, breaks, graphs = eval((tmp_path / f"{run}_{rank}.said").read_text())
            assert said == [] and breaks == {} and graphs > 0, (run, rank, said, breaks, graphs)
    run = read_run(tmp_path / "per_block_logged_compiled")
    assert_same_run(run, _without_blocks(one), range(EAGERLY_LOGGED), ACTIVATIONS + PARAMETERS)
    assert {"activation/std/tok_embeddings", "activation/std/head.output"} <= set(run.scalars)
    for rank in range(2):
        said, _, _ = eval((tmp_path / f"per_block_logged_compiled_{rank}.said").read_text())
        assert all("set_stance('force_eager' if hooks.recording else 'default')" in w for w in said), said
        named = [w.split("'")[1] for w in said]
        assert len(named) == len(set(named)) and {"layers.0.attention.wq", "layers.1.feed_forward.w2"} <= set(named)


def _without_blocks(run: Run) -> Run:
    """``run`` without the activation, input and output-gradient tags of the modules inside the blocks."""
    kept = {tag: not (tag.startswith(ACTIVATIONS) and "/layers." in tag) for tag in [*run.scalars, *run.histograms]}
    return Run({t: v for t, v in run.scalars.items() if kept[t]}, {t: v for t, v in run.histograms.items() if kept[t]})


def _embedding() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB)).double()


def _parallel_embedding(mesh: object) -> nn.Module:
    """A ``RowwiseParallel`` embedding: its weight is ``Shard(0)``, its gradient ``Replicate``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    return parallelize_module(_embedding(), mesh, {"0": RowwiseParallel(input_layouts=Replicate())})  # type: ignore[arg-type]


def _one_process(root: Path, modules: list[str], replicas: list[int], **options: object) -> Path:
    log_dir = root / f"one_{len(modules)}_{len(replicas)}{''.join(options)}"
    if not log_dir.exists():
        _train(Llama(), str(log_dir), modules, replicas, **options)
    return log_dir


def test_torchtitan_tensor_parallel_llama_logs_what_one_process_logs(tmp_path: Path) -> None:
    spawn_ranks(_tensor_parallel, tmp_path, 2)
    for run, modules in (("tp2_all", EVERYTHING), ("loss_parallel", EVERYTHING)):
        one = read_run(_one_process(tmp_path, modules, [0]))
        assert_same_run(read_run(tmp_path / run), one, range(STEPS), ACTIVATIONS + PARAMETERS)
    # The blocks alone, with attention=True: each rank attends over its own heads.
    one = read_run(_one_process(tmp_path, BLOCKS, [0], attention=True))
    assert_same_run(read_run(tmp_path / "tp2_blocks"), one, range(STEPS), (*ACTIVATIONS, *PARAMETERS, "attention/"))
    # Every step's gradient norm counts the embedding's Replicate gradient once, not once a rank;
    # with reduce_ranks=True the loss of the whole logits, a copy on each rank, counts once too.
    _train(_embedding(), str(tmp_path / "one_embedding"), ["0", "1"], [0])
    run, one = read_run(tmp_path / "embedding"), read_run(tmp_path / "one_embedding")
    assert_same_run(run, one, range(STEPS), (*ACTIVATIONS, *PARAMETERS, "step/grad_norm", "step/loss"))


def _four_ranks(rank: int, root: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _train(parallelize_llama(Llama(), init_device_mesh("cpu", (4,))), f"{root}/tp4", EVERYTHING, [0])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = parallelize_llama(Llama(), mesh["tp"])
    for key, block in model.layers.items():  # activation checkpointing, then FSDP2, as torchtitan applies them
        model.layers[key] = fully_shard(checkpoint_wrapper(block), mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    _train(model, f"{root}/2d", EVERYTHING, [mesh.get_local_rank("dp")])


def test_torchtitan_llama_at_tp4_and_under_fsdp2_with_tensor_parallel(tmp_path: Path) -> None:
    spawn_ranks(_four_ranks, tmp_path, 4)
    one = read_run(_one_process(tmp_path, EVERYTHING, [0]))
    assert_same_run(read_run(tmp_path / "tp4"), one, range(STEPS), ACTIVATIONS + PARAMETERS)
    # Under dp 2: parameters are those of the gradient averaged over both replicas' batches;
    # activations those of the writing rank's batch (at the first step, before the weights differ),
    # its output gradients those of the averaged loss: FSDP2's divide factor 2 (left at its default
    # here) halves its own loss's.
    both, run = read_run(_one_process(tmp_path, EVERYTHING, [0, 1])), read_run(tmp_path / "2d")
    assert_same_run(run, both, range(STEPS), PARAMETERS[:-1])
    assert_same_run(run, one, range(1), ACTIVATIONS, gradients=0.5)
