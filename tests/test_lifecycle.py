"""Hook removal, garbage collection, copies of the model, resumed runs, shared directories and
stock torchvision models."""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import threading
import warnings
import weakref
from collections.abc import Iterator

import pytest
import torch
import torchvision
from conftest import hook_dicts, read_run, read_tags, read_text
from models import conv_net, mlp, train
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
from torch.optim.swa_utils import AveragedModel
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger, HookLoggerError
from tblog_hooks.output import destination


def _shaped_net() -> nn.Sequential:
    """The conv net of these tests, its LazyLinear head shaped by a first forward."""
    model = conv_net(classes=2, batch_norm=True, lazy=True)
    model(torch.randn(1, 3, 8, 8))
    return model


def _losses(model: nn.Module, steps: int, scale: float = 1.0) -> Iterator[torch.Tensor]:
    """Each step's loss: the sum of the model's outputs for a fresh batch of two images."""
    return (model(torch.randn(2, 3, 8, 8) * scale).sum() for _ in range(steps))


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01)


def test_close_removes_every_handle_and_is_idempotent(tmp_path) -> None:
    model = _shaped_net()
    for optimizer in (False, True):
        opt = _sgd(model)
        hooks = HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt if optimizer else None)
        assert any(hook_dicts(model, opt))
        train(hooks, _losses(model, 2), opt)
        model(torch.randn(2, 3, 8, 8))  # a logged forward whose backward never comes
        hooks.close()
        hooks.close()
        assert not any(hook_dicts(model, opt))
        with pytest.raises(HookLoggerError, match="after close"):
            hooks.step()


def test_exception_inside_with_still_removes_hooks_and_writes(tmp_path) -> None:
    model = _shaped_net()
    with pytest.raises(KeyError), HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        train(hooks, _losses(model, 1), _sgd(model))
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        raise KeyError("boom")
    assert not any(hook_dicts(model))
    assert set(read_run(tmp_path).scalars["activation/mean/0.0"]) == {0, 1}  # the step in flight too


@pytest.mark.parametrize(
    ("optimizer", "close_first"), [(False, True), (False, False), (True, False)], ids=["closed", "open", "optimizer"]
)
def test_the_logger_does_not_keep_the_model_alive(tmp_path, optimizer: bool, close_first: bool) -> None:
    """Dropped after close(), or while the logger is attached (forgotten, or with optimizer=):
    the model is collected, and the logger's step() and close() go on with nothing left to watch."""
    model = _shaped_net()
    opt = _sgd(model)
    hooks = HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt if optimizer else None)
    train(hooks, _losses(model, 2), opt)
    ref = weakref.ref(model)
    if close_first:
        hooks.close()
    del model
    gc.collect()
    assert ref() is None
    if not close_first:
        hooks.step()  # nothing left to watch, nothing to warn about
        hooks.close()
    assert "closed" in repr(hooks)


def test_user_writer_is_flushed_not_closed(tmp_path) -> None:
    writer = SummaryWriter(tmp_path)
    model = _shaped_net()
    with HookLogger(model, writer=writer, every=1) as hooks:
        train(hooks, _losses(model, 1), _sgd(model))
    writer.add_scalar("user/after", 1.0, 0)
    writer.close()
    run = read_run(tmp_path)
    assert "user/after" in run.scalars and "activation/mean/0.0" in run.scalars


def test_stock_resnet18_with_inplace_relu_and_residual_add(tmp_path) -> None:
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["layer1.*", nn.Linear]) as hooks:
        losses = (nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])) for _ in range(2))
        train(hooks, losses, opt)
    run = read_run(tmp_path)
    # The reused ReLU of a BasicBlock is called twice per step; both calls are pooled.
    assert "activation/mean/layer1.0.relu" in run.scalars
    assert run.scalar("gradient/norm/layer1.0.bn2", 1) > 0
    assert run.scalar("param_grad/norm/fc.weight", 1) > 0
    assert set(run.scalars["param_grad/global_norm"]) == {0, 1}


def test_copies_of_the_model_never_log_and_hold_no_hook_of_ours(tmp_path) -> None:
    """Deep copies and an EMA made while attached, and a copy of the optimizer (as checkpointing code makes)."""
    model = _shaped_net()
    opt = _sgd(model)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        mean = float(model[0][0](x).double().mean())  # the reference, before the logger is attached
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks:
        clone = copy.deepcopy(opt)
        twin, ema = copy.deepcopy(model), AveragedModel(model)
        assert not any(hook_dicts(twin) + hook_dicts(ema))  # the copies leave our hooks out
        torch.compile(copy.deepcopy(twin), backend="aot_eager", fullgraph=True)(torch.randn(2, 3, 8, 8))
        # In logged step 0: a copy never calls into the logger.
        twin(torch.randn(5, 3, 8, 8) * 100).sum().backward()
        ema(torch.randn(5, 3, 8, 8) * 100).sum().backward()
        ema.update_parameters(model)
        train(hooks, [model(x).sum()], opt)
        assert not any(hook_dicts(twin) + hook_dicts(ema))
    run = read_run(tmp_path)
    assert run.scalar("activation/mean/0.0", 0) == pytest.approx(mean, rel=1e-5)  # the model's call only
    assert run.histograms["activation/0.0"][0].num == 2 * 4 * 6 * 6
    assert not any(hook_dicts(model, opt)) and not any(hook_dicts(twin, clone))
    assert not any(hook_dicts(ema))


_LOAD_WITHOUT_TBLOG_HOOKS = """
import sys, torch
sys.modules["tblog_hooks"] = None  # as if not installed: importing it raises ModuleNotFoundError
for path in sys.argv[1:]:
    checkpoint = torch.load(path, weights_only=False)
    checkpoint["model"](torch.randn(2, 3, 8, 8)).sum().backward()
    checkpoint["optimizer"].step()
    print("loaded")
"""


def test_checkpoint_saved_while_attached_loads_without_the_library(tmp_path) -> None:
    paths = []
    for optimizer in (False, True):  # parameter gradients read by tensor hooks, or by optimizer hooks
        model = _shaped_net()
        opt = _sgd(model)
        with HookLogger(model, log_dir=tmp_path / "run", every=1, optimizer=opt if optimizer else None) as hooks:
            train(hooks, _losses(model, 1), opt)
            model(torch.randn(2, 3, 8, 8)).sum().backward()  # mid-step: output and parameter hooks in place
            paths.append(tmp_path / f"checkpoint-{optimizer}.pt")
            torch.save({"model": model, "optimizer": opt}, paths[-1])
        assert b"tblog_hooks" not in paths[-1].read_bytes()
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_WITHOUT_TBLOG_HOOKS, *map(str, paths)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.split() == ["loaded", "loaded"], done.stderr


def _writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if type(t).__name__ == "_AsyncWriterThread"]


def test_dropped_logger_stops_recording_and_closes_its_writer(tmp_path) -> None:
    """The notebook habit: re-running ``hooks = HookLogger(model, ...)`` without ``close()``."""
    model = _shaped_net()
    threads = _writer_threads()
    hooks = HookLogger(model, log_dir=tmp_path, every=1)
    train(hooks, _losses(model, 2), _sgd(model))
    model(torch.randn(2, 3, 8, 8))  # a logged step open, with tensor hooks on its outputs
    buffer, logger = hooks._recording.buffer, weakref.ref(hooks)
    hooks = None  # re-bound: the logger is dropped without close()
    gc.collect()
    assert logger() is None
    assert not any(hook_dicts(model)) and not buffer.active
    assert _writer_threads() == threads  # the writer was closed, its thread joined
    sizes, rows = sorted(p.stat().st_size for p in tmp_path.iterdir()), len(buffer._records)
    for _ in range(3):  # the model trains on
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert len(buffer._records) == rows  # nothing recorded any more
    assert sorted(p.stat().st_size for p in tmp_path.iterdir()) == sizes
    assert set(read_run(tmp_path).scalars["activation/mean/0.0"]) == {0, 1}


def test_second_logger_on_a_model_with_a_live_one_warns_once(tmp_path) -> None:
    model = _shaped_net()
    hooks = HookLogger(model, log_dir=tmp_path / "a", every=1)
    with pytest.warns(UserWarning, match=r"already carries the hooks of another live HookLogger") as caught:
        hooks = HookLogger(model, log_dir=tmp_path / "b", every=1)  # a re-run cell
    assert len(caught) == 1
    gc.collect()
    assert all(len(m._forward_hooks) == 1 for m in model.modules() if m._forward_hooks)  # the old ones are gone
    hooks.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        HookLogger(model, log_dir=tmp_path / "c").close()  # no live logger left: no warning


def test_resumed_run_continues_at_start_step_and_replaces_what_followed_the_checkpoint(tmp_path) -> None:
    model = _shaped_net()
    with HookLogger(model, log_dir=tmp_path, every=10) as hooks:
        train(hooks, _losses(model, 45))  # logged 0..40, then the run "crashes" after its checkpoint at step 25
    with HookLogger(model, log_dir=tmp_path, every=10, start_step=25) as hooks:
        assert hooks.global_step == 25
        train(hooks, _losses(model, 20, scale=1000.0))  # steps 25..44: logged 30 and 40, recognisably
    maxima = read_run(tmp_path).scalars["activation/max/0.0"]
    assert set(maxima) == {0, 10, 20, 30, 40}  # one series, no zig-zag
    assert all(maxima[s] < 100 for s in (0, 10, 20)) and all(maxima[s] > 100 for s in (30, 40))


def test_start_step_on_a_multiple_of_every_logs_its_first_step(tmp_path) -> None:
    model = _shaped_net()
    with HookLogger(model, log_dir=tmp_path, every=5, start_step=10) as hooks:
        train(hooks, _losses(model, 6))
    assert set(read_run(tmp_path).scalars["activation/mean/0.0"]) == {10, 15}


def _layouts(log_dir) -> list[layout_pb2.Layout]:
    events = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    return [
        layout_pb2.Layout.FromString(e.tensor_proto.string_val[0]) for e in events.Tensors("custom_scalars__config__")
    ]


@pytest.mark.parametrize("shared", ["writer", "log_dir"])
def test_two_models_in_one_directory_with_prefixes(tmp_path, shared: str) -> None:
    generator, discriminator = (mlp(4, 4, 4, act=nn.ReLU) for _ in range(2))
    writer = SummaryWriter(tmp_path) if shared == "writer" else None
    where = {"writer": writer} if writer else {"log_dir": tmp_path}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # distinct prefixes: no warning
        g_hooks = HookLogger(generator, every=1, prefix="G", **where)
        d_hooks = HookLogger(discriminator, every=1, prefix="D", **where)
    for _ in range(2):
        discriminator(generator(torch.randn(3, 4))).sum().backward()
        d_hooks.step()  # D writes its layout first
        g_hooks.step()
    g_hooks.close()
    d_hooks.close()
    if writer:
        writer.close()
    tags = read_tags(tmp_path)
    assert {"G/activation/mean/0", "D/activation/mean/0", "G/param_grad/global_norm"} <= set(tags["scalars"])
    assert all(t.startswith(("G/", "D/")) for t in tags["scalars"] + tags["histograms"] + tags["images"])
    assert {"G/health/gradient_flow", "D/health/gradient_flow"} <= set(tags["images"])
    assert read_text(tmp_path, "G/health/forward_order") == {0: "1. `0`\n2. `2`"}
    latest = _layouts(tmp_path)[-1]  # what TensorBoard shows: the run's latest layout
    assert [c.title for c in latest.category] == ["D/tblog_hooks", "G/tblog_hooks"]
    for category in latest.category:
        chart = next(c for c in category.chart if c.title == "gradient/norm")
        prefix = category.title.split("/")[0]
        assert list(chart.multiline.tag) == [f"^{prefix}/gradient/norm/0$", f"^{prefix}/gradient/norm/2$"]


def test_second_logger_writing_the_same_tags_into_one_directory_warns(tmp_path) -> None:
    def model() -> nn.Module:
        return mlp(4, 4, 4, act=nn.ReLU)

    writer = SummaryWriter(tmp_path)
    first = HookLogger(model(), writer=writer, prefix="run")
    with pytest.warns(UserWarning, match=r"already writes into .* with prefix='run'.*own prefix=") as caught:
        second = HookLogger(model(), log_dir=tmp_path, prefix="run")
    assert len(caught) == 1
    first.close()
    second.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the first is closed: no warning
        HookLogger(model(), writer=writer, prefix="run").close()
    writer.close()


def test_writer_closed_by_the_user_mid_run_is_not_reopened(tmp_path) -> None:
    threads = _writer_threads()
    writer = SummaryWriter(tmp_path)
    model = _shaped_net()
    hooks = HookLogger(model, writer=writer, every=1)
    train(hooks, _losses(model, 2))
    writer.close()
    with pytest.warns(RuntimeWarning, match=r"writer= .* was closed while the logger was attached") as caught:
        train(hooks, _losses(model, 2))
        hooks.close()
    assert len(caught) == 1
    assert len(list(tmp_path.iterdir())) == 1 and _writer_threads() == threads
    assert set(read_run(tmp_path).scalars["activation/mean/0.0"]) == {0, 1}


def _live_tensors() -> int:
    """The tensors the garbage collector tracks (every tensor a Python object holds)."""
    return sum(issubclass(type(o), torch.Tensor) for o in gc.get_objects())


def _optimizer_hooks() -> tuple[int, int]:
    return len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)


def _one_logged_step(log_dir, width: int) -> weakref.ref[HookLogger]:
    """A logger with ``numerics=``, ``spikes=`` and ``optimizer=`` (each with optimizer hooks of
    its own) on a model whose first output has ``64 * width`` elements (above
    ``sampling.SAMPLE_CAP`` its median is taken of a sample, whose indices are made once per
    size), one logged step written, closed; the model, its optimizer and the logger are dropped
    on return."""
    model = mlp(4, width, 1, act=nn.ReLU, seed=width)
    opt, before = _sgd(model), _optimizer_hooks()
    hooks = HookLogger(model, log_dir=log_dir / str(width), every=1, numerics=True, spikes=True, optimizer=opt)
    assert all(now > was for now, was in zip(_optimizer_hooks(), before))
    train(hooks, [model(torch.randn(64, 4)).square().mean()], opt)
    hooks.close()
    assert "activation/median_abs/0" in read_run(log_dir / str(width)).scalars
    return weakref.ref(hooks)


def test_closed_loggers_leave_nothing_behind(tmp_path) -> None:
    """20 loggers with ``numerics=`` on differently shaped models, each closed: afterwards none of
    them, none of their tensors (the sample indices of each size among them), optimizer hooks or
    live destinations is left in the process."""
    _one_logged_step(tmp_path, 150)  # (what torch itself makes on first use, made before counting)
    gc.collect()
    tensors, hooks, live = _live_tensors(), _optimizer_hooks(), set(destination._LIVE)
    loggers = [_one_logged_step(tmp_path, width) for width in range(200, 220)]
    gc.collect()
    assert [logger() for logger in loggers] == [None] * 20
    assert _optimizer_hooks() == hooks
    assert set(destination._LIVE) == live
    assert _live_tensors() == tensors


def _two_runs(root, *, together: bool) -> None:
    """A logger with ``numerics=`` and one without, each on its own model and writer (directory),
    trained on the same batches: alive at once and stepped in turn, or one after the other."""
    models = {"a": mlp(4, 200, 1, act=nn.ReLU, seed=0), "b": mlp(4, 8, 8, 1, seed=1)}
    options = {"a": {"numerics": True}, "b": {"histograms": 1, "inputs": True}}
    batches = [torch.randn(64, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]

    def attach(name: str) -> HookLogger:
        return HookLogger(models[name], log_dir=root / name, every=1, **options[name])  # type: ignore[arg-type]

    def step(name: str, hooks: HookLogger, x: torch.Tensor) -> None:
        models[name](x).square().mean().backward()
        hooks.step()

    if together:
        both = {name: attach(name) for name in models}
        assert len(destination._LIVE) == 2
        for x in batches:
            for name, hooks in both.items():
                step(name, hooks, x)
        for hooks in both.values():
            hooks.close()
    else:
        for name in models:
            with attach(name) as hooks:
                for x in batches:
                    step(name, hooks, x)


def test_two_loggers_on_two_writers_alive_at_once_stay_independent(tmp_path) -> None:
    """Each run of two loggers alive at once, on two writers, is what its logger writes alone:
    its scalars, histograms and chart layout (no chart of the other's), and none is left live."""
    live = set(destination._LIVE)
    _two_runs(tmp_path / "together", together=True)
    _two_runs(tmp_path / "alone", together=False)
    assert set(destination._LIVE) == live
    for name in ("a", "b"):
        together, alone = tmp_path / "together" / name, tmp_path / "alone" / name
        assert read_run(together).scalars == read_run(alone).scalars, name
        assert read_tags(together) == read_tags(alone), name
        assert _layouts(together)[-1] == _layouts(alone)[-1], name
    assert "activation/median_abs/0" in read_run(tmp_path / "together" / "a").scalars
    assert not any("median_abs" in tag for tag in read_run(tmp_path / "together" / "b").scalars)
