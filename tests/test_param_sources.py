"""Where parameter gradients are read: unfrozen, assigned and replaced parameters and modules,
several or replaced optimizers, optimizers that take a closure, fused optimizers under GradScaler,
gradients clipped between backward and the optimizer step."""

from __future__ import annotations

import copy
import gc
import math
import warnings
import weakref

import pytest
import torch
from conftest import needs_cuda, read_run
from models import mlp
from torch import nn
from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks

from tblog_hooks import HookLogger, HookLoggerError
from tblog_hooks.capture import parameters


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def _norm(t: torch.Tensor) -> float:
    return float(t.detach().double().norm())


def _logged(log_dir, tag: str) -> dict[int, float]:
    return read_run(log_dir).scalars.get(tag, {})


def _ratio(before: torch.Tensor, after: torch.Tensor) -> float:
    return _norm(after - before) / _norm(before)


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_layer_unfrozen_later_is_logged_from_the_next_logged_step(tmp_path, with_optimizer: bool) -> None:
    model = mlp(6, 16, 16, 3)
    model[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    x = torch.randn(8, 6)
    grads: dict[int, float] = {}
    ratios: dict[int, float] = {}
    with HookLogger(model, log_dir=tmp_path, every=2, optimizer=opt if with_optimizer else None) as hooks:
        for step in range(7):
            if step == 3:
                model[0].requires_grad_(True)
                opt.add_param_group({"params": model[0].parameters()})
            opt.zero_grad()
            _loss(model(x)).backward()
            weight = model[0].weight.detach().clone()
            if model[0].weight.grad is not None:
                grads[step] = _norm(model[0].weight.grad)
            opt.step()
            ratios[step] = _ratio(weight, model[0].weight)
            hooks.step()
    assert _logged(tmp_path, "param_grad/norm/0.weight") == pytest.approx({4: grads[4], 6: grads[6]}, rel=1e-5)
    if with_optimizer:
        assert _logged(tmp_path, "param/update_ratio/0.weight") == pytest.approx({4: ratios[4], 6: ratios[6]})
    assert set(_logged(tmp_path, "param_grad/norm/4.weight")) == {0, 2, 4, 6}


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_parameters_assigned_after_attaching_are_read(tmp_path, with_optimizer: bool) -> None:
    model = mlp(6, 16, 16, 3)
    checkpoint = {key: value * 0.5 for key, value in model.state_dict().items()}
    old = model[4].weight
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    expected: dict[int, float] = {}
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt if with_optimizer else None) as hooks:
        for step in range(3):
            if step == 1:  # resuming: new parameter tensors, and an optimizer made for them
                model.load_state_dict(checkpoint, assign=True)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            opt.zero_grad()
            _loss(model(x)).backward()
            expected[step] = _norm(model[4].weight.grad)
            opt.step()
            hooks.step()
    assert model[4].weight is not old  # the scenario: new parameter objects, another gradient
    assert expected[1] != pytest.approx(expected[0], rel=1e-2)
    if not with_optimizer:  # gradient hooks go on the parameters when a logged step begins (the step() before it)
        del expected[1]
    assert _logged(tmp_path, "param_grad/norm/4.weight") == pytest.approx(expected, rel=1e-5)


def test_replaced_module_is_reported_once_and_a_wrapped_one_keeps_logging(tmp_path) -> None:
    model = mlp(6, 16, 16, 3)
    x = torch.randn(8, 6)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught, HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        warnings.simplefilter("always")
        for step in range(4):
            if step == 1:
                old = weakref.ref(model[2])
                model[2] = nn.Linear(16, 16)  # a new layer: its predecessor gets no more calls
                model[0] = nn.Sequential(model[0])  # moved to "0.0" by a wrapper: still called, still logged
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            opt.zero_grad()
            _loss(model(x)).backward()
            opt.step()
            hooks.step()
        gc.collect()
        assert old() is None  # the logger keeps no replaced module alive
    messages = [str(w.message) for w in caught if "no longer part of the model" in str(w.message)]
    assert len(messages) == 1 and "'2'" in messages[0]
    assert set(_logged(tmp_path, "param_grad/norm/2.weight")) == {0}
    assert set(_logged(tmp_path, "activation/mean/2")) == {0}
    assert set(_logged(tmp_path, "param_grad/norm/0.weight")) == {0, 1, 2, 3}
    assert set(_logged(tmp_path, "activation/mean/0")) == {0, 1, 2, 3}


@pytest.mark.parametrize("optimizer", ["LBFGS", "SGD"])
def test_closure_optimizer_logs_the_gradients_of_its_own_step(tmp_path, optimizer: str) -> None:
    """``optimizer.step(closure)``, as LBFGS needs and Lightning calls it: the step pre-hook runs before
    the closure's backward, and LBFGS evaluates the closure several times a step (the last one counts)."""
    model = mlp(6, 16, 16, 3)
    if optimizer == "LBFGS":
        opt: torch.optim.Optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 6), torch.randn(16, 3)
    seen: list[dict[str, float]] = []

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        seen.append({name: _norm(p.grad) for name, p in model.named_parameters()})
        return loss

    expected: dict[str, dict[int, float]] = {}
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks:
        for step in range(3):
            before = {name: p.detach().clone() for name, p in model.named_parameters()}
            seen.clear()
            opt.step(closure) if step % 2 else opt.step(closure=closure)
            for name, p in model.named_parameters():  # the closure's last gradient, and the update it made
                expected.setdefault(f"param_grad/norm/{name}", {})[step] = seen[-1][name]
                expected.setdefault(f"param/update_ratio/{name}", {})[step] = _ratio(before[name], p)
            norms = seen[-1].values()
            expected.setdefault("param_grad/global_norm", {})[step] = math.sqrt(sum(n * n for n in norms))
            hooks.step()
    assert (len(seen) > 1) == (optimizer == "LBFGS")  # LBFGS evaluated the closure more than once
    assert len(set(expected["param_grad/norm/4.weight"].values())) == 3
    for tag, values in expected.items():
        assert _logged(tmp_path, tag) == pytest.approx(values, rel=1e-5), tag


@pytest.mark.parametrize("given", ["G", "both"])
def test_two_optimizers_each_parameter_read_when_its_own_optimizer_steps(tmp_path, given: str) -> None:
    g, d = mlp(4, 8, 6), mlp(6, 8, 1)
    model = nn.ModuleDict({"G": g, "D": d})
    opt_g, opt_d = torch.optim.Adam(g.parameters(), lr=0.05), torch.optim.Adam(d.parameters(), lr=0.05)
    real = torch.randn(16, 6) + 1
    expected: dict[str, dict[int, float]] = {}
    with (
        warnings.catch_warnings(),
        HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt_g if given == "G" else [opt_g, opt_d]) as hooks,
    ):
        warnings.simplefilter("error")  # every watched parameter is stepped: nothing to warn about
        for step in range(3):
            z = torch.randn(16, 4)
            opt_d.zero_grad()
            loss_d = nn.functional.softplus(-d(real)).mean() + nn.functional.softplus(d(g(z).detach())).mean()
            loss_d.backward()
            weight = d[0].weight.detach().clone()
            expected.setdefault("param_grad/norm/D.0.weight", {})[step] = _norm(d[0].weight.grad)
            opt_d.step()
            expected.setdefault("param/update_ratio/D.0.weight", {})[step] = _ratio(weight, d[0].weight)
            opt_g.zero_grad()
            nn.functional.softplus(-d(g(z))).mean().backward()  # also accumulates into D's .grad
            weight = g[2].weight.detach().clone()
            expected.setdefault("param_grad/norm/G.2.weight", {})[step] = _norm(g[2].weight.grad)
            opt_g.step()
            expected.setdefault("param/update_ratio/G.2.weight", {})[step] = _ratio(weight, g[2].weight)
            hooks.step()
    for tag, values in expected.items():
        assert _logged(tmp_path, tag) == pytest.approx(values, rel=1e-5), tag


def test_replaced_optimizer_and_converted_parameters_keep_being_read(tmp_path) -> None:
    model = mlp(6, 16, 16, 3)
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    grads: dict[int, float] = {}
    ratios: dict[int, float] = {}
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks:
        for step in range(3):
            if step == 1:
                opt = torch.optim.Adam(model.parameters(), lr=0.01)  # the optimizer given is not used any more
            if step == 2:
                previous = torch.__future__.get_overwrite_module_params_on_conversion()
                torch.__future__.set_overwrite_module_params_on_conversion(True)
                try:
                    model.to(torch.float64)  # new parameter objects
                finally:
                    torch.__future__.set_overwrite_module_params_on_conversion(previous)
                opt = torch.optim.Adam(model.parameters(), lr=0.01)
                x = x.double()
            opt.zero_grad()
            _loss(model(x)).backward()
            weight = model[4].weight.detach().clone()
            grads[step] = _norm(model[4].weight.grad)
            opt.step()
            ratios[step] = _ratio(weight, model[4].weight)
            hooks.step()
    assert _logged(tmp_path, "param_grad/norm/4.weight") == pytest.approx(grads, rel=1e-5)
    assert _logged(tmp_path, "param/update_ratio/4.weight") == pytest.approx(ratios, rel=1e-5)


def test_parameters_no_optimizer_steps_are_left_out_with_one_warning(tmp_path) -> None:
    model = mlp(6, 16, 16, 3)
    opt = torch.optim.SGD(model[4].parameters(), lr=0.1)  # fine-tuning the head; the rest still gets gradients
    x = torch.randn(8, 6)
    with (
        pytest.warns(RuntimeWarning, match=r"4 watched parameter\(s\) \('0.weight', '0.bias'") as caught,
        HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks,
    ):
        for _ in range(3):
            model.zero_grad()
            _loss(model(x)).backward()
            opt.step()
            hooks.step()
    assert len([w for w in caught if "no torch.optim optimizer stepped them" in str(w.message)]) == 1
    logged = {tag for tag in read_run(tmp_path).scalars if tag.startswith("param_grad/norm/")}
    assert logged == {"param_grad/norm/4.weight", "param_grad/norm/4.bias"}


@pytest.mark.parametrize("unscale_first", [False, True])  # scaler.unscale_(opt) before clipping, say
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_fused_optimizer_under_grad_scaler_logs_unscaled_gradients(tmp_path, device: str, unscale_first: bool) -> None:
    model = mlp(6, 16, 16, 3).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
    scaler = torch.amp.GradScaler(device, init_scale=2.0**16)
    x = torch.randn(8, 6, device=device)
    expected: dict[int, float] = {}
    largest: dict[int, float] = {}
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt, scaler=scaler, histograms=1) as hooks:
        for step in range(3):
            opt.zero_grad()
            poison = math.inf if step == 1 else 1.0  # the scaler skips step 1
            scaler.scale(_loss(model(x)) * poison).backward()
            scale = float(scaler.get_scale())
            expected[step] = _norm(model[4].weight.grad) / scale  # a power of two: exact
            largest[step] = float(model[4].weight.grad.double().max()) / scale
            if unscale_first:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
            hooks.step()
    assert _logged(tmp_path, "param_grad/norm/4.weight") == pytest.approx({0: expected[0], 2: expected[2]}, rel=1e-5)
    assert _logged(tmp_path, "amp/skipped_step") == {0: 0.0, 1: 1.0, 2: 0.0}
    hist = read_run(tmp_path).histograms["param_grad/4.weight"]
    assert set(hist) == {0, 2}
    assert hist[2].max == pytest.approx(largest[2], rel=1e-5)


def test_optimizer_hooks_are_removed_on_close(tmp_path) -> None:
    model = mlp(6, 16, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=[opt]) as hooks:
        assert len(_global_optimizer_pre_hooks) == before[0] + 2  # steps counted (every logger), gradients read
        hooks.step()
    assert (len(_global_optimizer_pre_hooks), len(_global_optimizer_post_hooks)) == before
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


@pytest.mark.parametrize(("bad", "got"), [([], "list of nothing"), (("sgd",), "tuple of str"), ("sgd", "str")])
def test_optimizer_must_be_optimizers(tmp_path, bad: object, got: str) -> None:
    with pytest.raises(HookLoggerError, match=rf"a non-empty list or tuple of them .*, got {got}$"):
        HookLogger(mlp(6, 16, 16, 3), log_dir=tmp_path, optimizer=bad)


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_clipped_gradients_are_logged_only_with_the_optimizer(tmp_path, with_optimizer: bool) -> None:
    model = mlp(6, 16, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt if with_optimizer else None) as hooks:
        model(torch.randn(8, 6)).square().sum().backward()
        raw = float(nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5))
        opt.step()
        hooks.step()
    assert raw > 1  # the scenario: clipping changed the gradients
    assert _logged(tmp_path, "param_grad/global_norm") == pytest.approx({0: 0.5 if with_optimizer else raw}, rel=1e-5)


def test_fault_in_the_optimizer_hooks_is_reported_once_and_training_unchanged(tmp_path, monkeypatch) -> None:
    def broken(optimizer: object) -> None:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(parameters, "grad_scale", broken)
    model = mlp(6, 16, 16, 3)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6)
    final = []
    for net, logged in ((model, True), (reference, False)):
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hooks = HookLogger(net, log_dir=tmp_path, every=1, optimizer=opt) if logged else None
            for _ in range(3):
                opt.zero_grad()
                _loss(net(x)).backward()
                opt.step()
                if hooks is not None:
                    hooks.step()
            if hooks is not None:
                hooks.close()
        final.append([p.detach().clone() for p in net.parameters()])
        if logged:
            messages = [str(w.message) for w in caught]
            assert len(messages) == 1 and "logging for 'parameters' failed" in messages[0], messages
    assert all(torch.equal(a, b) for a, b in zip(*final))
    assert set(_logged(tmp_path, "activation/mean/0")) == {0, 1, 2}


def test_module_that_left_is_not_logged_even_if_still_called(tmp_path) -> None:
    model = mlp(6, 16, 16, 3)
    x = torch.randn(8, 6)
    with warnings.catch_warnings(record=True), HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        warnings.simplefilter("always")
        for step in range(3):
            if step == 1:
                old, model[4] = model[4], nn.Linear(16, 3)
            out = model(x)
            if step >= 1:
                out = out + old(model[:4](x))  # the old head, now outside the model, still called
            _loss(out).backward()
            hooks.step()
    # Noticed when logged step 2 begins (step 1 had begun, in step 0's step(), before the change).
    assert set(_logged(tmp_path, "activation/mean/4")) == {0, 1}
    assert set(_logged(tmp_path, "param_grad/norm/4.weight")) == {0, 1}
