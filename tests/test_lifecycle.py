"""Selection, hook removal, garbage collection and stock torchvision models."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
import torchvision
from conftest import hook_dicts, read_run
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger, HookLoggerError


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


def test_copies_of_the_optimizer_get_inert_hooks(tmp_path) -> None:
    model = _net()
    model(torch.randn(1, 3, 8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks:
        clone = copy.deepcopy(opt)  # e.g. checkpointing code that copies the optimizer
        _train(model, hooks, steps=1, opt=opt)
    assert not any(hook_dicts(model, opt))
    assert all(h.__name__ == "inert_hook" for h in clone._optimizer_step_pre_hooks.values())
