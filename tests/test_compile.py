"""A logger attached before ``torch.compile`` logs what it logs in eager mode (output gradients
included), with two graphs and no graph break, and leaves training unchanged."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import Run, needs_cuda, read_run
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

from tblog_hooks import Histograms, HookLogger, HookLoggerError
from tblog_hooks.capture.step import COMPILE_VERIFIED, TORCH_VERSION
from tblog_hooks.stats.tags import HISTOGRAM_KINDS as KINDS

if torch.distributed.is_available():
    # As in a pipeline-parallel training's process: the hooks look for a pipeline schedule only
    # outside traced code (a walk of the frames in it would recompile every step).
    import torch.distributed.pipelining

#: Below the version the compiled hooks are verified on, the logger says so (tests/test_torch_versions.py)
#: and these tests do not hold (a GPU's torch 2.11 recompiled each step): what they check is not claimed there.
pytestmark = pytest.mark.skipif(
    TORCH_VERSION < COMPILE_VERIFIED, reason=f"compiled hooks are verified on torch >= {COMPILE_VERIFIED} only"
)


class _Block(nn.Module):
    """A residual block with the in-place ops of torchvision's ResNet (``out += x``, ``ReLU(inplace=True)``)
    after the watched ``fc``; with ``recompute``, run under activation checkpointing."""

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.fc, self.act, self.recompute = nn.Linear(16, 16), nn.ReLU(inplace=True), recompute

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc(x)
        out += x
        return self.act(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._forward, x, use_reentrant=False) if self.recompute else self._forward(x)


class _Net(nn.Module):
    """``shared`` runs twice per forward (one module, two calls)."""

    def __init__(self, recompute: bool = False) -> None:
        super().__init__()
        self.inp, self.block = nn.Linear(6, 16), _Block(recompute)
        self.shared, self.out = nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.shared(torch.tanh(self.shared(self.block(self.inp(x))))))


#: Every histogram kind on every logged step, so that each can be compared with eager mode.
EVERY_HISTOGRAM = Histograms(every_logged=1, weights_every_logged=1, kinds=[k for k in KINDS if k != "input"])


def _train(
    log_dir: Path,
    *,
    backend: str | None,
    device: str = "cpu",
    recompute: bool = False,
    scale: float | None = None,
    histograms: bool | Histograms = EVERY_HISTOGRAM,
    moved: bool = False,
    wrap: Callable[[Callable[[torch.Tensor], torch.Tensor], HookLogger], Callable[[torch.Tensor], torch.Tensor]]
    | None = None,
    mode: str | None = None,
    gradients: bool = True,
    numerics: bool = False,
) -> tuple[Run, nn.Module]:
    """5 optimizer steps of 2 micro-batches each (gradient accumulation), every=2: steps 0, 2, 4
    logged. With ``moved``, the logger is made while the model is on the meta device; ``wrap``
    wraps the (compiled) model's calls; ``mode``: ``torch.compile``'s."""
    torch.manual_seed(0)
    model = _Net(recompute).to(device)
    data = torch.randn(5, 2, 8, 6).to(device)
    weights = model.state_dict()
    if moved:  # the logger's parameters are the meta ones: no parameter gradients then
        model = _Net(recompute).to("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = None if scale is None else torch.amp.GradScaler(device, init_scale=scale)
    optimizer = None if moved else opt
    with HookLogger(
        model,
        log_dir=log_dir,
        every=2,
        optimizer=optimizer,
        scaler=scaler,
        histograms=histograms,
        gradients=gradients,
        numerics=numerics,
    ) as hooks:
        if moved:
            model.to_empty(device=device).load_state_dict(weights)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
        run = model if backend is None else torch.compile(model, backend=backend, mode=mode)
        # CUDA graphs with gradient accumulation need .grad made outside the graphs' memory.
        stable_grads = mode == "reduce-overhead"
        for p in model.parameters() if stable_grads else ():
            p.grad = torch.zeros_like(p)
        if wrap is not None:
            run = wrap(run, hooks)
        for batches in data:
            for x in batches:
                loss = run(x).square().mean()
                (loss if scaler is None else scaler.scale(loss)).backward()
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            opt.zero_grad(set_to_none=not stable_grads)
            hooks.step()
    return read_run(log_dir), model


def _assert_same_scalars(compiled: Run, eager: Run, prefixes: tuple[str, ...] = ("",)) -> None:
    tags = {tag for tag in eager.scalars if tag.startswith(prefixes)}
    assert tags == {tag for tag in compiled.scalars if tag.startswith(prefixes)}
    for tag in tags:
        assert set(compiled.scalars[tag]) == set(eager.scalars[tag]) == {0, 2, 4}, tag
        for step, value in eager.scalars[tag].items():
            assert compiled.scalar(tag, step) == pytest.approx(value, rel=1e-4, abs=1e-7), (tag, step)


@pytest.mark.parametrize(
    ("backend", "device"),
    [
        ("aot_eager", "cpu"),
        ("inductor", "cpu"),  # inductor builds C++ kernels: ~45 s here with a cold cache
        pytest.param(
            "inductor",
            "cuda",
            marks=needs_cuda,
        ),
    ],
)
def test_compiled_model_logs_what_eager_logs(tmp_path: Path, backend: str, device: str) -> None:
    eager, eager_model = _train(tmp_path / "eager", backend=None, device=device)
    torch._dynamo.reset()
    counters.clear()
    compiled, compiled_model = _train(tmp_path / "compiled", backend=backend, device=device)
    # One graph for logged steps, one for the others: no recompilation per step or micro-batch, no graph break.
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]
    assert {"gradient/norm/block.fc", "gradient/nonfinite/shared", "gradient/norm/out"} <= set(compiled.scalars)
    _assert_same_scalars(compiled, eager)
    for tag, by_step in eager.histograms.items():
        if tag.endswith("/shared") and tag.startswith("gradient"):  # see the next test
            continue
        for step, want in by_step.items():
            got = compiled.histograms[tag][step]
            assert (got.min, got.max) == pytest.approx((want.min, want.max), rel=1e-4, abs=1e-7), (tag, step)
            assert got.num == want.num, (tag, step)
    for a, b in zip(eager_model.parameters(), compiled_model.parameters()):  # training is unchanged
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _as_under_cuda_graphs(
    run: Callable[[torch.Tensor], torch.Tensor], hooks: HookLogger
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``run`` as under ``mode="reduce-overhead"``: the next call of a CUDA graph writes over its
    previous outputs, among them what the compiled hooks recorded (the micro-batch before)."""
    sink = hooks._recording.buffer.traced.sink
    outputs: list[torch.Tensor] = []

    def items() -> list[object]:
        found, link = [], sink._head
        while link.prev is not None:
            found.append(link.item)
            link = link.prev
        return found

    def call(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            for t in outputs:
                t.fill_(1e30 if t.is_floating_point() else 12345)
        outputs.clear()
        before = {id(item) for item in items()}
        out = run(x)
        for item in items():
            if id(item) not in before:
                held = item.values if hasattr(item, "values") else (item.sample, item.lo, item.hi, item.weight)
                outputs.extend(t for t in held if t is not None)
        return out

    return call


@pytest.mark.parametrize("gradients", [True, False])
def test_records_of_each_micro_batch_are_copied_out_of_cuda_graph_memory(tmp_path: Path, gradients: bool) -> None:
    """Gradient accumulation under CUDA graphs: the first micro-batch's records are kept as computed,
    in its backward, by the probes (``gradients=True``) or a hook on one trained parameter."""
    kinds = [k for k in KINDS if k != "input" and (gradients or not k.startswith("gradient"))]
    options = {"gradients": gradients, "histograms": Histograms(every_logged=1, weights_every_logged=1, kinds=kinds)}
    eager, _ = _train(tmp_path / "eager", backend=None, **options)  # type: ignore[arg-type]
    torch._dynamo.reset()
    compiled, _ = _train(tmp_path / "compiled", backend="aot_eager", wrap=_as_under_cuda_graphs, **options)  # type: ignore[arg-type]
    _assert_same_scalars(compiled, eager)
    _assert_same_histograms(compiled, eager)


@needs_cuda
def test_cuda_graphs_with_gradient_accumulation_log_what_eager_logs(tmp_path: Path) -> None:
    """``mode="reduce-overhead"``: each micro-batch's forward runs a CUDA graph over the last one's outputs."""
    eager, _ = _train(tmp_path / "eager", backend=None, device="cuda")
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = _train(tmp_path / "graphs", backend="inductor", device="cuda", mode="reduce-overhead")
    assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs were skipped: this test would not exercise them"
    _assert_same_scalars(compiled, eager)
    _assert_same_histograms(compiled, eager)


def _assert_same_histograms(compiled: Run, eager: Run) -> None:
    for tag, by_step in eager.histograms.items():
        if tag.startswith("gradient") and tag.endswith("/shared"):
            continue  # (not written for compiled models: see the test with checkpointing)
        for step, want in by_step.items():
            got = compiled.histograms[tag][step]
            assert (got.min, got.max, got.num) == pytest.approx((want.min, want.max, want.num), rel=1e-4), (tag, step)


def test_compiled_activations_and_gradients_log_numerics_as_eager(tmp_path: Path) -> None:
    """``numerics=``'s output, output-gradient and parameter-gradient statistics in the compiled
    graph, without a graph break or another graph; of ``shared``'s two calls, whose summaries
    autograd adds up in its probe, all but the gradient's amax (a maximum does not add up)."""
    eager, _ = _train(tmp_path / "eager", backend=None, histograms=False, numerics=True)
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = _train(tmp_path / "compiled", backend="aot_eager", histograms=False, numerics=True)
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]
    assert "activation/underflow_bf16/block.fc" in compiled.scalars
    assert "gradient/amax/out" in compiled.scalars and "gradient/underflow_bf16/shared" in compiled.scalars
    del eager.scalars["gradient/amax/shared"]
    _assert_same_scalars(compiled, eager, ("activation/", "gradient/", "param_grad/"))


def test_compiled_output_gradients_with_checkpointing_and_grad_scaler(tmp_path: Path) -> None:
    eager, _ = _train(tmp_path / "eager", backend=None)
    torch._dynamo.reset()
    counters.clear()
    # Activation records are side effects, which dynamo refuses inside a checkpointed region
    # unless told that eager checkpointing's replay of them in backward may be skipped.
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        compiled, _ = _train(tmp_path / "compiled", backend="aot_eager", recompute=True, scale=1024.0)
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]
    assert not any(compiled.scalars["amp/skipped_step"].values())
    _assert_same_scalars(compiled, eager, ("gradient/", "activation/"))  # unscaled gradients
    # Autograd adds up the gradients of a module's two calls in one forward before the logger
    # sees them: the norm is right, a histogram of them would not be, so none is written.
    assert "gradient/shared" in eager.histograms
    assert "gradient/shared" not in compiled.histograms
    assert {"gradient/block.fc", "gradient_log10/block.fc"} <= set(compiled.histograms)


def test_a_model_moved_after_the_logger_was_made_gets_output_gradients_from_the_next_logged_step(
    tmp_path: Path,
) -> None:
    eager, _ = _train(tmp_path / "eager", backend=None, histograms=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = _train(tmp_path / "compiled", backend="aot_eager", histograms=False, moved=True)
    # Step 0 found the probes on the meta device; they followed the outputs, which made one more graph.
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"]
    for tag in ("gradient/norm/block.fc", "gradient/nonfinite/out", "gradient/norm/shared"):
        assert set(compiled.scalars[tag]) == {2, 4}
        for step in (2, 4):
            assert compiled.scalar(tag, step) == pytest.approx(eager.scalar(tag, step), rel=1e-4, abs=1e-7)
    assert not compiled.histograms


def test_attaching_to_a_compiled_model_is_a_clear_error(tmp_path: Path) -> None:
    model = _Net()
    with pytest.raises(HookLoggerError, match="create the HookLogger first"):
        HookLogger(torch.compile(model, backend="aot_eager"), log_dir=tmp_path)
    model.compile(backend="aot_eager")
    with pytest.raises(HookLoggerError, match="already compiled"):
        HookLogger(model, log_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_histogram_cadence_keeps_two_graphs(tmp_path: Path) -> None:
    """Compiled hooks sample on every logged step; the steps the schedule skips drop the samples."""
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = _train(tmp_path, backend="aot_eager", histograms=Histograms(every_logged=2, weights_every_logged=2))
    assert counters["stats"]["unique_graphs"] == 2
    assert not counters["graph_break"]
    assert set(compiled.histograms["activation/inp"]) == set(compiled.histograms["gradient_log10/out"]) == {0, 4}
    assert "gradient/out" not in compiled.histograms  # not among the default kinds
    assert set(compiled.scalars["gradient/norm/out"]) == {0, 2, 4}


def _spiking(log_dir: Path, fullgraph: bool | None) -> Run:
    """5 steps of 2 micro-batches with ``spikes=True`` (every step's norm, loss and samples), the
    model compiled whole (``fullgraph``; ``None``: eager)."""
    torch.manual_seed(0)
    model, data = _Net(), torch.randn(5, 2, 8, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=log_dir, every=2, optimizer=opt, spikes=True) as hooks:
        run = model if fullgraph is None else torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
        for batches in data:
            losses = [run(x).square().mean() for x in batches]
            for loss in losses:
                loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=sum(losses) / 2)
    return read_run(log_dir)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_compiled_model_writes_every_steps_spike_series_as_eager(tmp_path: Path, fullgraph: bool) -> None:
    """``spikes=True``: the model's pre-hook that counts a step's samples is traced into the
    compiled forward, where it asks no question dynamo cannot trace (whether it runs in backward:
    training stopped with ``fullgraph=True``); every step's series as eager mode's, no graph break."""
    eager = _spiking(tmp_path / "eager", None)
    torch._dynamo.reset()
    counters.clear()
    compiled = _spiking(tmp_path / "compiled", fullgraph)
    assert not counters["graph_break"]
    series = {"step/grad_norm", "step/loss", "step/samples"}
    assert series <= set(eager.scalars) and eager.scalars["step/samples"] == {s: 16.0 for s in range(5)}
    for tag in series:
        assert compiled.scalars[tag] == pytest.approx(eager.scalars[tag], rel=1e-5), tag
