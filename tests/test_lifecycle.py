"""Selection, hook removal, garbage collection and stock torchvision models."""

from __future__ import annotations

import copy
import gc
import subprocess
import sys
import threading
import warnings
import weakref

import pytest
import torch
import torchvision
from conftest import hook_dicts, read_run, read_tags, read_text
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from torch import nn
from torch.optim.swa_utils import AveragedModel
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger, HookLoggerError
from tblog_hooks.capture.hooks import NOOP


def _net() -> nn.Module:
    return nn.Sequential(
        nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()),
        nn.Sequential(nn.Conv2d(4, 4, 3), nn.BatchNorm2d(4), nn.ReLU()),
        nn.Flatten(),
        nn.LazyLinear(2),
    )


def _train(model: nn.Module, hooks: HookLogger, steps: int = 2, opt: torch.optim.Optimizer | None = None) -> None:
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        hooks.step()


def test_select_by_name_glob_type_and_predicate(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    cases = {
        "0.0": ("0.0",),
        "1.*": ("1.0", "1.1", "1.2"),
        nn.Conv2d: ("0.0", "1.0"),
        (lambda name, m: isinstance(m, nn.ReLU)): ("0.1", "1.2"),
    }
    for selector, names in cases.items():
        with HookLogger(model, log_dir=tmp_path, modules=selector) as hooks:
            assert hooks.module_names == names
    with HookLogger(model, log_dir=tmp_path) as hooks:  # default: leaf modules owning parameters
        assert hooks.module_names == ("0.0", "1.0", "1.1", "3")
    with HookLogger(model, log_dir=tmp_path, modules=["1.*", nn.Conv2d]) as hooks:
        assert hooks.module_names == ("0.0", "1.0", "1.1", "1.2")


def test_unknown_names_are_one_error_listing_close_matches(tmp_path) -> None:
    model = _net()
    with pytest.raises(HookLoggerError) as info:
        HookLogger(model, log_dir=tmp_path, modules=["1.O", "layer*", nn.LSTM, "0.0"])
    message = str(info.value)
    assert "'1.O'" in message and "1.0" in message  # closest existing name offered
    assert "'layer*'" in message and "LSTM" in message
    assert "'0.0'" not in message  # only the selectors that matched nothing
    assert not list(tmp_path.iterdir())  # nothing written for a logger that never started


def test_close_removes_every_handle_and_is_idempotent(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    for optimizer in (False, True):
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        hooks = HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt if optimizer else None)
        assert any(hook_dicts(model, opt))
        _train(model, hooks, opt=opt)
        model(torch.randn(2, 3, 8, 8))  # a logged forward whose backward never comes
        hooks.close()
        hooks.close()
        assert not any(hook_dicts(model, opt))
        with pytest.raises(HookLoggerError, match="after close"):
            hooks.step()


def test_exception_inside_with_still_removes_hooks_and_writes(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    with pytest.raises(KeyError), HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        _train(model, hooks, steps=1)
        model(torch.randn(2, 3, 8, 8)).sum().backward()
        raise KeyError("boom")
    assert not any(hook_dicts(model))
    assert set(read_run(tmp_path).scalars["activation/mean/0.0"]) == {0, 1}  # the step in flight too


def test_model_is_collectable_after_close(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    hooks = HookLogger(model, log_dir=tmp_path, every=1)
    _train(model, hooks)
    ref = weakref.ref(model)
    hooks.close()
    del model
    gc.collect()
    assert ref() is None
    assert "closed" in repr(hooks)


def test_forgotten_logger_does_not_keep_model_alive(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    hooks = HookLogger(model, log_dir=tmp_path, every=1)
    _train(model, hooks)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None
    hooks.close()


def test_user_writer_is_flushed_not_closed(tmp_path) -> None:
    writer = SummaryWriter(tmp_path)
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    with HookLogger(model, writer=writer, every=1) as hooks:
        _train(model, hooks, steps=1)
    writer.add_scalar("user/after", 1.0, 0)
    writer.close()
    run = read_run(tmp_path)
    assert "user/after" in run.scalars and "activation/mean/0.0" in run.scalars


def test_stock_resnet18_with_inplace_relu_and_residual_add(tmp_path) -> None:
    model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["layer1.*", nn.Linear]) as hooks:
        for _ in range(2):
            nn.functional.cross_entropy(model(torch.randn(2, 3, 32, 32)), torch.tensor([1, 2])).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    run = read_run(tmp_path)
    # The reused ReLU of a BasicBlock is called twice per step; both calls are pooled.
    assert "activation/mean/layer1.0.relu" in run.scalars
    assert run.scalar("gradient/norm/layer1.0.bn2", 1) > 0
    assert run.scalar("param_grad/norm/fc.weight", 1) > 0
    assert set(run.scalars["param_grad/global_norm"]) == {0, 1}


def test_copies_hold_no_hook_of_ours_after_close(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks:
        clone = copy.deepcopy(opt)  # e.g. checkpointing code that copies the optimizer
        twin, ema = copy.deepcopy(model), AveragedModel(model)  # EMA: deep copies made while attached
        twin_hooks = [h for d in hook_dicts(twin) for h in d.values()]
        assert twin_hooks and all(h is NOOP for h in twin_hooks)  # in place of ours, until close()
        torch.compile(copy.deepcopy(twin), backend="aot_eager", fullgraph=True)(torch.randn(2, 3, 8, 8))
        twin(torch.randn(5, 3, 8, 8)).sum().backward()  # in logged step 0: a copy never calls into the logger
        _train(model, hooks, steps=1, opt=opt)
    assert read_run(tmp_path).histograms["activation/0.0"][0].num == 2 * 4 * 6 * 6  # the model's batch only
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
        model = _net()
        model(torch.randn(1, 3, 8, 8))
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with HookLogger(model, log_dir=tmp_path / "run", every=1, optimizer=opt if optimizer else None) as hooks:
            _train(model, hooks, steps=1, opt=opt)
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
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    threads = _writer_threads()
    hooks = HookLogger(model, log_dir=tmp_path, every=1)
    _train(model, hooks)
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
    model = _net()
    model(torch.randn(1, 3, 8, 8))
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


def _steps(model: nn.Module, hooks: HookLogger, n: int, scale: float = 1.0) -> None:
    for _ in range(n):
        model(torch.randn(2, 3, 8, 8) * scale).sum().backward()
        hooks.step()


def test_resumed_run_continues_at_start_step_and_replaces_what_followed_the_checkpoint(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    with HookLogger(model, log_dir=tmp_path, every=10) as hooks:
        _steps(model, hooks, 45)  # logged 0..40, then the run "crashes" after its checkpoint at step 25
    with HookLogger(model, log_dir=tmp_path, every=10, start_step=25) as hooks:
        assert hooks.global_step == 25
        _steps(model, hooks, 20, scale=1000.0)  # steps 25..44: logged 30 and 40, recognisably
    maxima = read_run(tmp_path).scalars["activation/max/0.0"]
    assert set(maxima) == {0, 10, 20, 30, 40}  # one series, no zig-zag
    assert all(maxima[s] < 100 for s in (0, 10, 20)) and all(maxima[s] > 100 for s in (30, 40))


def test_start_step_on_a_multiple_of_every_logs_its_first_step(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    with HookLogger(model, log_dir=tmp_path, every=5, start_step=10) as hooks:
        _steps(model, hooks, 6)
    assert set(read_run(tmp_path).scalars["activation/mean/0.0"]) == {10, 15}


def _layouts(log_dir) -> list[layout_pb2.Layout]:
    events = event_accumulator.EventAccumulator(str(log_dir), size_guidance={event_accumulator.TENSORS: 0})
    events.Reload()
    return [
        layout_pb2.Layout.FromString(e.tensor_proto.string_val[0]) for e in events.Tensors("custom_scalars__config__")
    ]


@pytest.mark.parametrize("shared", ["writer", "log_dir"])
def test_two_models_in_one_directory_with_prefixes(tmp_path, shared: str) -> None:
    generator, discriminator = (nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)) for _ in range(2))
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
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

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
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    hooks = HookLogger(model, writer=writer, every=1)
    _steps(model, hooks, 2)
    writer.close()
    with pytest.warns(RuntimeWarning, match=r"writer= .* was closed while the logger was attached") as caught:
        _steps(model, hooks, 2)
        hooks.close()
    assert len(caught) == 1
    assert len(list(tmp_path.iterdir())) == 1 and _writer_threads() == threads
    assert set(read_run(tmp_path).scalars["activation/mean/0.0"]) == {0, 1}


def test_repeated_deep_copies_do_not_pile_up(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    with HookLogger(model, log_dir=tmp_path) as hooks:
        for _ in range(3):  # e.g. a copy for evaluation every few hundred steps, then dropped
            copy.deepcopy(model)
        gc.collect()
        kept = copy.deepcopy(model)
        assert len(hooks._recording.handles._copies) == sum(bool(d) for d in hook_dicts(kept))  # the live copy's only
    assert not any(hook_dicts(kept))
