"""Bad input is one clear ``HookLoggerError`` at construction (or at misuse), naming what is valid."""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger, HookLoggerError


def _model() -> nn.Sequential:
    return nn.Sequential(OrderedDict(encoder=nn.Linear(4, 8), act=nn.ReLU(), decoder=nn.Linear(8, 2)))


def _error(*args: object, **kwargs: object) -> str:
    with pytest.raises(HookLoggerError) as info:
        HookLogger(*args, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "fragments"),
    [
        ({"every": 0}, ["every must be a positive int", "0"]),
        ({"every": 2.5}, ["every must be a positive int", "2.5"]),
        ({"every": True}, ["every must be a positive int", "True"]),
        ({"modules": "encodr"}, ["'encodr' (closest names: encoder, decoder)"]),
        ({"modules": ["decoder", "lyaer*"]}, ["'lyaer*' (no similar name; the model's names: encoder, act, decoder)"]),
        ({"modules": nn.Conv2d}, ["Conv2d (no module of this type; the model's types: Sequential, Linear, ReLU)"]),
        ({"modules": []}, ["selected no module", "glob patterns"]),
        ({"modules": lambda name, m: False}, ["selected no module", "predicates"]),
        ({"modules": 3}, ["modules= got 3", "nn.Module subclass"]),
        ({"evry": 10}, ["unknown option(s) 'evry' (did you mean 'every'?)", "valid options: modules, every, "]),
        ({"activations": False, "gradients": False, "parameters": False}, ["nothing would be logged"]),
        ({"optimizer": "sgd"}, ["optimizer must be a torch.optim.Optimizer", "str"]),
        ({"start_step": -1}, ["start_step must be an int >= 0", "-1"]),
        ({"start_step": 2.0}, ["start_step must be an int >= 0", "2.0"]),
        ({"start_step": True}, ["start_step must be an int >= 0", "True"]),
        ({"prefix": ""}, ["prefix must be a non-empty str", "got ''"]),
        ({"prefix": "/G"}, ["without a leading or trailing '/'", "got '/G'"]),
        ({"prefix": "G/"}, ["without a leading or trailing '/'", "got 'G/'"]),
        ({"prefix": 1}, ["prefix must be a non-empty str", "got 1"]),
    ],
)
def test_bad_option_names_the_value_and_what_is_valid(tmp_path, kwargs: dict, fragments: list[str]) -> None:
    message = _error(_model(), log_dir=tmp_path, **kwargs)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert not list(tmp_path.iterdir())  # rejected before any file is written


def test_not_a_module() -> None:
    message = _error(lambda x: x)
    assert "model must be an nn.Module" in message and "function" in message


def test_default_selection_on_a_model_without_parameters_is_empty(tmp_path) -> None:
    message = _error(nn.Sequential(nn.ReLU(), nn.Tanh()), log_dir=tmp_path)
    assert "selected no module" in message and "the modules that own parameters" in message


def test_writer_and_log_dir_together(tmp_path) -> None:
    writer = SummaryWriter(tmp_path / "mine")
    try:
        message = _error(_model(), writer=writer, log_dir=tmp_path / "other")
        assert "either log_dir" in message and "not both" in message
        assert "writer must be a torch.utils.tensorboard.SummaryWriter (or a subclass), got str;" in _error(
            _model(), writer="runs"
        )
    finally:
        writer.close()


def test_writer_of_another_library_is_named_with_its_module() -> None:
    foreign = type("SummaryWriter", (), {"__module__": "tensorboardX.writer"})()  # as tensorboardX's looks
    message = _error(_model(), writer=foreign)
    assert "got tensorboardX.writer.SummaryWriter;" in message
    assert "torch.utils.tensorboard.SummaryWriter (or a subclass)" in message and "pass log_dir=" in message


def _writer_threads() -> int:
    return sum(type(t).__name__ == "_AsyncWriterThread" for t in threading.enumerate())


def test_closed_writer_is_an_error_and_nothing_is_reopened(tmp_path) -> None:
    writer = SummaryWriter(tmp_path)
    writer.close()
    threads, files = _writer_threads(), sorted(tmp_path.iterdir())
    message = _error(_model(), writer=writer)
    assert "writer= was closed" in message and repr(str(tmp_path)) in message
    assert "pass an open SummaryWriter, or log_dir=" in message
    assert sorted(tmp_path.iterdir()) == files and _writer_threads() == threads


def _unwritable_dirs(tmp_path) -> list[str]:
    (tmp_path / "file").write_text("")
    dirs = [str(tmp_path / "file"), str(tmp_path / "file" / "run")]  # a file in the way
    if sys.platform == "linux":
        dirs += ["/proc/self/run", "/sys/kernel"]  # cannot be created / no files inside, even for root
    return dirs


def test_unwritable_log_dir_fails_before_a_writer_thread_starts(tmp_path) -> None:
    threads = threading.active_count()
    for log_dir in _unwritable_dirs(tmp_path):
        message = _error(_model(), log_dir=log_dir)
        assert f"log_dir={log_dir!r} must be a directory this process can create files in" in message
        assert "writer=SummaryWriter(...)" in message
    assert threading.active_count() == threads  # a failed SummaryWriter would leave its thread running


def test_step_and_with_after_close_are_errors_and_hooks_are_inert(tmp_path) -> None:
    model = _model()
    hooks = HookLogger(model, log_dir=tmp_path, every=1)
    model(torch.randn(3, 4)).sum().backward()
    hooks.step()
    hooks.close()
    with pytest.raises(HookLoggerError, match=r"step\(\) called after close\(\); create a new HookLogger"):
        hooks.step()
    with pytest.raises(HookLoggerError, match="closed HookLogger; create a new HookLogger"), hooks:
        pass
    # The model keeps training after close(): no hook of the logger runs, nothing is written.
    files = sorted(p.stat().st_size for p in tmp_path.iterdir())
    model(torch.randn(3, 4)).sum().backward()
    assert sorted(p.stat().st_size for p in tmp_path.iterdir()) == files
    assert hooks.global_step == 1 and hooks.closed


def test_a_selector_like_no_name_shows_the_first_names_of_a_large_model(tmp_path) -> None:
    model = nn.Sequential(*(nn.Linear(2, 2) for _ in range(12)))
    message = _error(model, log_dir=tmp_path, modules=["qqq"])
    assert "'qqq' (no similar name; the model's names: 0, 1, 2, 3, 4 (+7 more))" in message
