"""During training the logger never kills the run: injected faults are reported once, that part of
logging stops, and the model trains exactly as it would without the logger."""

from __future__ import annotations

import errno
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import read_run
from models import mlp, train
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger
from tblog_hooks.stats import binning, sampling
from tblog_hooks.stats.kinds import Kind
from tblog_hooks.stats.tags import Root

STEPS = 3


class Exotic(torch.Tensor):
    """A tensor subclass the statistics cannot handle (as some library types are)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.aminmax:
            raise NotImplementedError("aminmax is not defined for Exotic tensors")
        return super().__torch_function__(func, types, args, kwargs or {})


class Exotify(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.as_subclass(Exotic)


class Unwrap(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.as_subclass(torch.Tensor)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), Exotify(), Unwrap(), nn.Tanh(), nn.Linear(8, 2))


def _final_parameters(model: nn.Module, hooks: HookLogger | None, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters after a fixed training run."""
    data = torch.Generator().manual_seed(1)
    train(hooks, (model(torch.randn(16, 4, generator=data)).square().mean() for _ in range(STEPS)), opt)
    return [p.detach().clone() for p in model.parameters()]


def _reference_parameters() -> list[torch.Tensor]:
    model = _model()
    return _final_parameters(model, None, torch.optim.SGD(model.parameters(), lr=0.1))


@contextmanager
def _logger_warnings() -> Iterator[list[str]]:
    messages: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield messages
    messages += [str(w.message) for w in caught if str(w.message).startswith("tblog_hooks")]


def _run_with_logger(
    log_dir,
    *,
    writer: SummaryWriter | None = None,
    modules: list[str] | None = None,
    optimizer: bool = False,
    parameters: bool = True,
    before_training: Callable[[], None] | None = None,
) -> list[str]:
    """Train with the logger attached; assert the parameters equal a run without it; return its warnings."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _logger_warnings() as messages:
        hooks = HookLogger(
            model,
            log_dir=None if writer else log_dir,
            writer=writer,
            every=1,
            modules=modules or ["0", "1", "4"],
            optimizer=opt if optimizer else None,
            parameters=parameters,
        )
        if before_training:
            before_training()
        final = _final_parameters(model, hooks, opt)
        hooks.close()
    for got, expected in zip(final, _reference_parameters()):
        assert torch.equal(got, expected)  # the logger changed nothing in training
    return messages


def test_output_type_the_statistics_cannot_handle(tmp_path) -> None:
    messages = _run_with_logger(tmp_path)
    assert len(messages) == 1
    assert "logging for '1' failed and is switched off: NotImplementedError: aminmax" in messages[0]
    run = read_run(tmp_path)
    assert set(run.scalars["activation/mean/0"]) == set(run.scalars["gradient/norm/4"]) == set(range(STEPS))
    # Only the input count of module 1 (module 0's output) is logged, none of its own outputs.
    assert [tag for tag in [*run.scalars, *run.histograms] if tag.endswith("/1")] == ["input/nonfinite/1"]


@pytest.mark.parametrize(
    ("where", "expected", "logged"),
    [
        # In a tensor hook inside backward: step 0's activations were recorded before it.
        ("gradient", "logging for '0' failed", {0}),
        # In the forward hook, after the statistics row of step 0.
        ("sample", "logging for '0' failed", {0}),
    ],
)
def test_fault_in_a_statistic_is_reported_once(tmp_path, monkeypatch, where: str, expected: str, logged: set) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError(f"injected fault in {where}")

    if where == "gradient":  # the device function of output-gradient records
        compute = Kind.compute
        monkeypatch.setattr(
            Kind, "compute", lambda k, t, u, **kw: broken() if k.name == Root.GRADIENT else compute(k, t, u, **kw)
        )
    else:
        monkeypatch.setattr(sampling, "sample", broken)
    messages = _run_with_logger(tmp_path, modules=["0"], parameters=False)
    assert len(messages) == 1 and expected in messages[0] and f"injected fault in {where}" in messages[0]
    run = read_run(tmp_path)
    assert set(run.scalars.get("activation/mean/0", {})) == logged
    assert "gradient/norm/0" not in run.scalars


def test_fault_reading_parameter_gradients_is_reported_once(tmp_path, monkeypatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("injected fault in _foreach_norm")

    monkeypatch.setattr(torch, "_foreach_norm", broken)
    messages = _run_with_logger(tmp_path, optimizer=True)
    # The exotic module; every parameter at once from the optimizer hook; the update ratios,
    # which read weight norms with the same function: each part reported once.
    assert len(messages) == 3
    assert any("logging for 'parameters' failed" in m and "_foreach_norm" in m for m in messages)
    assert any("logging for 'update_ratio' failed" in m for m in messages)
    run = read_run(tmp_path)
    assert set(run.scalars["activation/mean/0"]) == set(range(STEPS))
    assert not any(tag.startswith("param") for tag in [*run.scalars, *run.histograms])


@pytest.mark.parametrize("optimizer", [False, True])
def test_freezing_and_unfreezing_a_layer_mid_training(tmp_path, optimizer: bool) -> None:
    model = mlp(4, 8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with _logger_warnings() as messages:
        hooks = HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt if optimizer else None)
        for step in range(3):
            model[0].requires_grad_(step != 1)  # frozen for step 1 only
            model(torch.randn(5, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
        hooks.close()
    assert messages == []
    run = read_run(tmp_path)
    # Without optimizer=, gradients are hooked when a logged step begins (in the step() before it):
    # step 2 began while layer 0 was still frozen.
    assert set(run.scalars["param_grad/norm/0.weight"]) == ({0, 2} if optimizer else {0})
    assert set(run.scalars["param_grad/norm/2.weight"]) == {0, 1, 2}


class FailingWriter(SummaryWriter):
    """A user's writer whose flush fails, as on a lost network file system."""

    def flush(self) -> None:
        raise OSError(errno.EIO, "Input/output error")


def test_writer_error_switches_logging_off_once(tmp_path) -> None:
    writer = FailingWriter(tmp_path)
    try:
        messages = _run_with_logger(tmp_path, writer=writer, modules=["0", "4"])
    finally:
        SummaryWriter.close(writer)
    assert len(messages) == 1  # not again from close()
    assert "writing step 0 to TensorBoard failed, so logging is switched off" in messages[0]
    assert "OSError: [Errno 5] Input/output error" in messages[0]


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_disk_full_switches_logging_off_once(tmp_path) -> None:
    def fill_disk() -> None:
        # Every write to the event file now fails with ENOSPC from the kernel, as on a full disk.
        (event_file,) = tmp_path.iterdir()
        event_file.unlink()
        event_file.symlink_to("/dev/full")

    threads = set(threading.enumerate())
    messages = _run_with_logger(tmp_path, modules=["0", "4"], before_training=fill_disk)
    for thread in set(threading.enumerate()) - threads:
        thread.join(timeout=30)  # TensorBoard's writer thread died of the error: let it finish here
    assert len(messages) == 1
    assert "writing step 0 to TensorBoard failed" in messages[0] and "No space left on device" in messages[0]
    assert str(tmp_path) in messages[0]


def _output_cases() -> dict[str, Callable[[torch.Tensor], object]]:
    """Module outputs that are not plain float tensors; none may fail, warn or be logged."""
    return {
        "int": lambda x: x.long(),
        "bool": lambda x: x > 0,
        "complex": lambda x: torch.complex(x, x),
        "sparse_coo": lambda x: x.to_sparse(),
        "sparse_csr": lambda x: x.reshape(x.shape[0], -1).to_sparse_csr(),
        "quantized": lambda x: torch.quantize_per_tensor(x.detach(), 0.1, 0, torch.quint8),
        "meta": lambda x: x.to("meta"),
        "empty": lambda x: x[:0],
        "float8": lambda x: x.to(torch.float8_e4m3fn),
        "nested": lambda x: torch.nested.nested_tensor([x[0], x[1, :2]]),
        "none_and_str": lambda x: (None, "text", 3),
    }


@pytest.mark.filterwarnings("ignore:.*(quantized|nested).*:UserWarning")
@pytest.mark.parametrize("case", sorted(_output_cases()))
def test_odd_outputs_are_skipped_without_warning(tmp_path, case: str) -> None:
    class Emit(nn.Module):
        def forward(self, x: torch.Tensor) -> object:
            return _output_cases()[case](x)

    model = nn.Sequential(nn.Linear(4, 4), Emit())
    with _logger_warnings() as messages, HookLogger(model, log_dir=tmp_path, every=1, modules=["0", "1"]) as hooks:
        for _ in range(2):
            model(torch.randn(3, 4))
            model[0](torch.randn(3, 4)).sum().backward()
            hooks.step()
    assert messages == []
    run = read_run(tmp_path)
    assert set(run.scalars["activation/mean/0"]) == {0, 1}
    # Only the input count of module 1 (module 0's output) is logged, none of its own outputs.
    assert [tag for tag in [*run.scalars, *run.histograms] if tag.endswith("/1")] == ["input/nonfinite/1"]


def _float_cases() -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Float outputs with unusual shapes or memory layouts; logged exactly. 8*16*12*12 > SAMPLE_CAP."""
    return {
        "zero_dim": lambda x: x.sum(),
        "non_contiguous": lambda x: x.transpose(1, 3),
        "channels_last": lambda x: x.contiguous(memory_format=torch.channels_last),
        "expanded": lambda x: x[:1].expand(8, -1, -1, -1),
        "float16": lambda x: x.half(),
        "bfloat16": lambda x: x.bfloat16(),
        "float64": lambda x: x.double(),
    }


@pytest.mark.parametrize("case", sorted(_float_cases()))
def test_unusual_float_outputs_are_logged_exactly(tmp_path, case: str) -> None:
    class Emit(nn.Module):
        def forward(self, x: torch.Tensor) -> object:
            return (None, _float_cases()[case](x))

    x = torch.randn(8, 16, 12, 12, requires_grad=True)
    model = nn.Sequential(Emit())
    with _logger_warnings() as messages, HookLogger(model, log_dir=tmp_path, every=1, modules=["0"]) as hooks:
        _, out = model(x)
        out.float().square().sum().backward()
        hooks.step()
    assert messages == []
    a = out.detach().double().reshape(-1)
    run = read_run(tmp_path)
    assert run.scalar("activation/mean/0", 0) == pytest.approx(float(a.mean()), rel=1e-4, abs=1e-5)
    assert run.scalar("activation/min/0", 0) == float(a.min())
    assert run.scalar("activation/max/0", 0) == float(a.max())
    if a.numel() > 1:
        assert run.scalar("activation/std/0", 0) == pytest.approx(float(a.std()), rel=1e-4)
    assert run.scalar("gradient/norm/0", 0) == pytest.approx(float(2 * a.norm()), rel=1e-3)
    hist = run.histograms["activation/0"][0]
    assert hist.num == a.numel()  # a subsample above the cap stands for every element
    assert (hist.min, hist.max) == (float(a.min()), float(a.max()))


def test_large_tensor_histogram_is_a_bounded_deterministic_sample_scalars_exact(tmp_path, monkeypatch) -> None:
    sizes: list[list[int]] = []
    histograms = binning.bin_rows

    def spy(samples, *args):  # type: ignore[no-untyped-def]
        sizes.append([s.numel() for s in samples])
        return histograms(samples, *args)

    monkeypatch.setattr(binning, "bin_rows", spy)
    layer = nn.Identity()
    x = torch.randn(300_001, dtype=torch.float64) ** 3  # heavy tails; an odd size
    for run_dir in ("a", "b"):
        with HookLogger(layer, log_dir=tmp_path / run_dir, every=1, modules=[""], parameters=False) as hooks:
            layer(x)
            layer(x[::2])  # a second call of the same module: pooled over the same bucket edges
            hooks.step()
    assert sizes == [[sampling.SAMPLE_CAP] * 2] * 2
    first, second = (read_run(tmp_path / d) for d in ("a", "b"))
    both = torch.cat([x, x[::2]]).numpy()
    assert first.scalar("activation/mean/root", 0) == pytest.approx(both.mean(), rel=1e-6)
    assert first.scalar("activation/std/root", 0) == pytest.approx(both.std(ddof=1), rel=1e-6)
    assert first.scalar("activation/min/root", 0) == np.float32(both.min())  # TensorBoard scalars are float32
    assert first.scalar("activation/max/root", 0) == np.float32(both.max())
    hist_a, hist_b = first.histograms["activation/root"][0], second.histograms["activation/root"][0]
    assert (hist_a.num, hist_a.min, hist_a.max) == (both.size, both.min(), both.max())
    assert list(hist_a.bucket) == list(hist_b.bucket) and list(hist_a.bucket_limit) == list(hist_b.bucket_limit)


def test_fault_in_a_compiled_hook_is_reported_once_outside_the_compiled_graph(tmp_path, monkeypatch) -> None:
    """A hook traced into a ``fullgraph=True`` graph that fails is reported once, when the step
    ends (a warning inside the graph is dynamo's ``Unsupported``, which ended training); that
    module's statistics stop, the others' go on, and the model trains as without the logger."""
    traced_sample = sampling.traced_sample

    def broken(t: torch.Tensor) -> torch.Tensor:
        if t.shape[-1] == 8:  # the Tanh's output, not the Linear's
            raise RuntimeError("injected fault in a traced sample")
        return traced_sample(t)

    monkeypatch.setattr(sampling, "traced_sample", broken)
    torch._dynamo.reset()
    model, reference = _model()[3:], _model()[3:]  # (Tanh, Linear: no tensor subclass in the compiled graph)
    opt, opt_reference = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    with _logger_warnings() as messages:
        hooks = HookLogger(model, log_dir=tmp_path, every=1, modules=["3", "4"], parameters=False, histograms=True)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        for step in range(STEPS):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            train(hooks, [compiled(x).square().mean()], opt)
            train(None, [reference(x).square().mean()], opt_reference)
        hooks.close()
    assert len(messages) == 1, messages
    assert "logging for '3' failed" in messages[0] and "injected fault in a traced sample" in messages[0]
    for got, expected in zip(model.parameters(), reference.parameters()):
        assert torch.equal(got, expected)
    run = read_run(tmp_path)
    assert set(run.scalars["activation/mean/4"]) == set(range(STEPS))
    assert set(run.scalars.get("activation/mean/3", {})) <= {0}
