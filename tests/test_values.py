"""Every logged statistic equals a reference computed independently in the test."""

from __future__ import annotations

import functools
import math
import warnings

import numpy as np
import pytest
import torch
from conftest import read_run
from models import mlp
from torch import nn

from tblog_hooks import HookLogger

# An in-place ReLU right after a hooked Linear: statistics must be taken before it runs.
INPLACE_RELU = functools.partial(nn.ReLU, inplace=True)


def _reference_stats(t: torch.Tensor) -> dict[str, float]:
    a = t.detach().double().numpy()
    return {
        "mean": a.mean(),
        "std": a.std(ddof=1),
        "min": a.min(),
        "max": a.max(),
        "zero_frac": float((a == 0).mean()),
        "nonfinite": float((~np.isfinite(a)).sum()),
        "dead_frac": float((a.reshape(a.shape[0], a.shape[1], -1).max(axis=(0, 2)) <= 0).mean()),
    }


@pytest.mark.parametrize("zero_grad_first", [False, True])
def test_scalars_match_reference(tmp_path, zero_grad_first: bool) -> None:
    model = mlp(6, 16, 3, act=INPLACE_RELU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected: dict[str, dict[int, float]] = {}

    def expect(tag: str, step: int, value: float) -> None:
        expected.setdefault(tag, {})[step] = value

    with HookLogger(model, log_dir=tmp_path, every=2) as hooks:
        assert hooks.module_names == ("0", "2")
        for step in range(5):
            if zero_grad_first:
                opt.zero_grad()
            x = torch.randn(32, 6) * 3 + 1
            # Run the layers by hand (hooks still fire) to keep independent references.
            h = model[0](x)
            h.retain_grad()
            h_before_relu = h.detach().clone()
            out = model[2](model[1](h))
            out.retain_grad()
            loss = out.square().mean()
            loss.backward()
            if step % 2 == 0:
                for stat, value in _reference_stats(h_before_relu).items():
                    expect(f"activation/{stat}/0", step, value)
                for stat, value in _reference_stats(out).items():
                    expect(f"activation/{stat}/2", step, value)
                assert h.grad is not None and out.grad is not None
                # h.grad follows the in-place ReLU; the Linear's own output gradient is masked.
                expect("gradient/norm/0", step, float((h.grad * (h_before_relu > 0)).double().norm()))
                expect("gradient/norm/2", step, float(out.grad.double().norm()))
                expect("gradient/nonfinite/0", step, 0.0)
                norms = {f"{m}.{p}": float(getattr(model[int(m)], p).grad.double().norm())
                         for m in ("0", "2") for p in ("weight", "bias")}  # fmt: skip
                for key, value in norms.items():
                    expect(f"param_grad/norm/{key}", step, value)
                expect("param_grad/global_norm", step, math.sqrt(sum(v * v for v in norms.values())))
            opt.step()
            if not zero_grad_first:
                opt.zero_grad()
            hooks.step()

    run = read_run(tmp_path)
    for tag, by_step in expected.items():
        assert set(run.scalars[tag]) == {0, 2, 4}, tag
        for step, value in by_step.items():
            assert run.scalar(tag, step) == pytest.approx(value, rel=1e-4, abs=1e-6), (tag, step)


def test_gradient_accumulation_reports_the_accumulated_grad(tmp_path) -> None:
    model = mlp(6, 16, 3, act=INPLACE_RELU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        for _ in range(3):  # three micro-batches, one optimizer step
            model(torch.randn(8, 6)).square().mean().backward()
        accumulated = float(model[0].weight.grad.norm())
        opt.step()
        opt.zero_grad()
        hooks.step()
    assert read_run(tmp_path).scalar("param_grad/norm/0.weight", 0) == pytest.approx(accumulated, rel=1e-5)


def test_a_backward_that_raises_does_not_cost_the_next_one_its_parameter_gradients(tmp_path) -> None:
    model = mlp(6, 16, 3, act=INPLACE_RELU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def broken(grad: torch.Tensor) -> None:
        raise RuntimeError("a failing backward")

    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        hidden = model[1](model[0](torch.randn(8, 6)))
        hidden.register_hook(broken)  # runs after model[2]'s gradients are accumulated
        with pytest.raises(RuntimeError, match="a failing backward"):
            model[2](hidden).square().mean().backward()
        opt.zero_grad()
        model(torch.randn(8, 6)).square().mean().backward()
        expected = {name: float(p.grad.norm()) for name, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        hooks.step()
    run = read_run(tmp_path)
    for name, norm in expected.items():
        assert run.scalar(f"param_grad/norm/{name}", 0) == pytest.approx(norm, rel=1e-5)


def test_optimizer_pre_hook_reads_grads_before_the_update(tmp_path) -> None:
    model = mlp(6, 16, 3, act=INPLACE_RELU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks:
        model(torch.randn(8, 6)).square().mean().backward()
        expected = float(model[2].bias.grad.norm())
        opt.step()
        opt.zero_grad()
        hooks.step()
    assert read_run(tmp_path).scalar("param_grad/norm/2.bias", 0) == pytest.approx(expected, rel=1e-5)


def test_histograms_match_numpy(tmp_path) -> None:
    layer = nn.Linear(10, 100)
    with HookLogger(layer, log_dir=tmp_path, every=1, modules=[""], gradients=False, parameters=False) as hooks:
        out = layer(torch.randn(20, 10)).detach().double().numpy().ravel()
        hooks.step()
    hist = read_run(tmp_path).histograms["activation/root"][0]
    assert hist.min == pytest.approx(out.min()) and hist.max == pytest.approx(out.max())
    assert hist.num == out.size  # 2,000 elements: below the sample cap, so exact
    limits = np.asarray(hist.bucket_limit)
    assert np.all(np.isfinite(limits)) and np.all(np.diff(limits) > 0)
    # Bucket i holds (limits[i-1], limits[i]]; the first starts at the minimum.
    edges = np.concatenate([[out.min()], limits])
    reference, _ = np.histogram(out, bins=edges)
    assert np.abs(np.asarray(hist.bucket) - reference).sum() <= 4  # float rounding at edges only
    assert sum(hist.bucket) == out.size


def test_tuple_and_dict_outputs_pool_floating_leaves(tmp_path) -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, x - 1

    class Named(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, object]:
            return {"y": x + 1, "index": x.argmax(dim=1), "none": None}

    model = nn.Sequential(Pair())
    named = Named()
    x = torch.randn(4, 5)
    with HookLogger(model, log_dir=tmp_path / "tuple", every=1, modules=[Pair]) as hooks:
        a, b = model(x)
        hooks.step()
    pooled = torch.cat([a.reshape(-1), b.reshape(-1)])
    run = read_run(tmp_path / "tuple")
    assert run.scalar("activation/mean/0", 0) == pytest.approx(float(pooled.mean()), rel=1e-5)
    assert run.scalar("activation/std/0", 0) == pytest.approx(float(pooled.std()), rel=1e-5)
    assert run.scalar("activation/min/0", 0) == pytest.approx(float(pooled.min()))

    with HookLogger(named, log_dir=tmp_path / "dict", every=1, modules=[""]) as hooks:
        y = named(x)["y"]
        hooks.step()
    assert read_run(tmp_path / "dict").scalar("activation/mean/root", 0) == pytest.approx(float(y.mean()), rel=1e-5)


def test_nonfinite_values_are_counted_and_kept_out_of_histograms(tmp_path) -> None:
    class Poison(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x.clone()
            y[0, 0], y[0, 1], y[1, 0] = math.nan, math.inf, -math.inf
            return y

    model = nn.Sequential(Poison())
    with HookLogger(model, log_dir=tmp_path, every=1, modules=[Poison]) as hooks:
        model(torch.randn(8, 8))
        hooks.step()
    run = read_run(tmp_path)
    assert run.scalar("activation/nonfinite/0", 0) == 3
    hist = run.histograms["activation/0"][0]
    assert hist.num == 61
    assert all(math.isfinite(v) for v in [hist.min, hist.max, *hist.bucket_limit])


def test_module_called_twice_aggregates_both_calls(tmp_path) -> None:
    layer = nn.Linear(4, 4)
    model = nn.Sequential(layer, nn.Tanh(), layer)  # shared weights
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["0"]) as hooks:
        x = torch.randn(16, 4)
        first = layer(x)
        second = layer(torch.tanh(first))
        hooks.step()
    both = torch.cat([first.detach().reshape(-1), second.detach().reshape(-1)]).double()
    run = read_run(tmp_path)
    assert run.scalar("activation/mean/0", 0) == pytest.approx(float(both.mean()), rel=1e-5)
    assert run.scalar("activation/std/0", 0) == pytest.approx(float(both.std()), rel=1e-5)
    assert run.histograms["activation/0"][0].num == both.numel()


@pytest.mark.parametrize("every", [1, 3, 7])
def test_logged_steps_are_multiples_of_every(tmp_path, every: int) -> None:
    model = mlp(6, 16, 3, act=INPLACE_RELU)
    with HookLogger(model, log_dir=tmp_path, every=every) as hooks:
        for _ in range(15):
            model(torch.randn(4, 6)).sum().backward()
            hooks.step()
    steps = set(read_run(tmp_path).scalars["activation/mean/0"])
    assert steps == set(range(0, 15, every))


def test_forward_calls_and_micro_batches_do_not_advance_the_step(tmp_path) -> None:
    model = mlp(6, 16, 3, act=INPLACE_RELU)
    with HookLogger(model, log_dir=tmp_path, every=2) as hooks:
        for _ in range(4):
            for _ in range(5):  # five forward/backward passes per optimizer step
                model(torch.randn(4, 6)).sum().backward()
            hooks.step()
    run = read_run(tmp_path)
    assert set(run.scalars["activation/mean/0"]) == {0, 2}
    assert run.histograms["activation/0"][0].num == 5 * 4 * 16


@pytest.mark.parametrize("inplace_between", [False, True])
def test_input_nonfinite_count_of_a_chained_module(tmp_path, inplace_between: bool) -> None:
    class Poison(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 1
            y[0, :2] = math.nan
            return y

    class PoisonInPlace(nn.Module):  # not watched: changes its input in place
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x[1, 0] = math.inf
            return x

    layers = [Poison(), *([PoisonInPlace()] if inplace_between else []), nn.Linear(4, 4)]
    model = nn.Sequential(*layers)
    with (
        torch.no_grad(),
        HookLogger(model, log_dir=tmp_path, every=1, modules=[Poison, nn.Linear], eval_passes=True) as hooks,
    ):
        model(torch.randn(3, 4))
        hooks.step()
    run = read_run(tmp_path)
    last = str(len(layers) - 1)
    assert run.scalar("activation/nonfinite/0", 0) == 2
    # The Linear's input is the Poison output, reused while unchanged, counted again if changed.
    assert run.scalar(f"input/nonfinite/{last}", 0) == (3 if inplace_between else 2)


def test_dead_fraction_of_micro_batches_counts_channels_never_positive_in_the_pooled_batch(tmp_path) -> None:
    """Channel 0 is positive only in the first micro-batch, channel 1 only in the second: no
    channel is dead in the pooled batch (averaging each call's fraction would say 0.5)."""
    layer = nn.Linear(2, 2, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(2))
    with HookLogger(layer, log_dir=tmp_path, every=1, modules=[""], parameters=False) as hooks:
        for x in ([[1.0, -1.0]], [[-1.0, 1.0]], [[-1.0, -2.0]]):
            layer(torch.tensor(x))
        hooks.step()
        layer(torch.tensor([[-1.0, 3.0], [-2.0, 1.0]]))
        hooks.step()
    dead = read_run(tmp_path).scalars["activation/dead_frac/root"]
    assert dead == {0: 0.0, 1: 0.5}


def test_an_inference_mode_evaluation_inside_a_logged_step_is_recorded_and_training_goes_on(tmp_path) -> None:
    model = mlp(6, 16, 3, act=INPLACE_RELU)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no module may be switched off
        with HookLogger(model, log_dir=tmp_path, every=1, eval_passes=True) as hooks:
            for _ in range(3):
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
                with torch.inference_mode():
                    model.eval()
                    evaluated = model(x)
                    model.train()
                hooks.step()
    run = read_run(tmp_path)
    assert set(run.scalars["activation/mean/2"]) == set(run.scalars["gradient/norm/0"]) == {0, 1, 2}
    # Step 2's output pools the training pass (before the update) and the evaluation (after it).
    assert run.scalar("activation/max/2", 2) >= float(evaluated.max())


def test_half_precision_parameter_gradients_are_accumulated_in_float32(tmp_path) -> None:
    """A float16 gradient of norm 131072 (its squares overflow float16) and a bfloat16 one."""
    for dtype in (torch.float16, torch.bfloat16):
        layer = nn.Linear(256, 256).to(dtype)
        with HookLogger(layer, log_dir=tmp_path / str(dtype), every=1, modules=[""]) as hooks:
            layer.weight.grad = torch.full_like(layer.weight, 512.0)
            layer.bias.grad = torch.full_like(layer.bias, 1.0 / 3)
            (layer(torch.ones(1, 256, dtype=dtype)).sum() * 0).backward()
            hooks.step()
        run = read_run(tmp_path / str(dtype))
        weight = layer.weight.grad.float().norm()
        bias = layer.bias.grad.float().norm()
        assert run.scalar("param_grad/norm/root.weight", 0) == pytest.approx(float(weight), rel=1e-6)
        assert run.scalar("param_grad/norm/root.bias", 0) == pytest.approx(float(bias), rel=1e-6)


def test_two_backward_passes_through_one_output_warn_once(tmp_path) -> None:
    """The passes' gradients are pooled as separate ones, sqrt(|g1|^2 + |g2|^2), and said so."""
    model = mlp(6, 16, 3, act=INPLACE_RELU)
    x = torch.randn(8, 6)
    grads: list[torch.Tensor] = []
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["0"]) as hooks:
        with pytest.warns(RuntimeWarning, match="second backward pass reached an output of '0'") as caught:
            out = model[0](x)
            out.register_hook(lambda g: grads.append(g.clone()))
            rest = model[2](model[1](out.clone()))  # (the ReLU is in place)
            rest.square().mean().backward(retain_graph=True)
            rest.abs().mean().backward()
            hooks.step()
        assert len([w for w in caught if "second backward" in str(w.message)]) == 1
    pooled = math.sqrt(sum(float(g.double().norm()) ** 2 for g in grads))
    assert read_run(tmp_path).scalar("gradient/norm/0", 0) == pytest.approx(pooled, rel=1e-5)


def test_an_exploding_gradient_is_logged_finite_and_found_exploding(tmp_path) -> None:
    """A finite gradient whose norm's square is past float32's range (norm ~1e21): its norms are
    the float64 ones, and it is an ``exploding_gradient``, not ``nonfinite``."""
    model = mlp(8, 32, 32, 2, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    at, outputs = 30, {}

    def keep_output_gradient(name: str, module: nn.Module, args: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: outputs.__setitem__(name, float(g.double().norm())))

    for name in ("0", "2", "4"):
        model[int(name)].register_forward_hook(functools.partial(keep_output_gradient, name))
    torch.manual_seed(1)
    with HookLogger(model, log_dir=tmp_path, every=5, optimizer=opt, spikes=True) as hooks:
        for step in range(at + 1):
            loss = model(torch.randn(16, 8)).square().mean()
            (loss * (1e21 if step == at else 1.0)).backward()
            params = {n: float(p.grad.double().norm()) for n, p in model.named_parameters()}
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
        kinds = {(f.kind, f.step) for f in hooks.findings}
    assert max(params.values()) > 1e20  # (squares past float32's 3.4e38)
    run = read_run(tmp_path)
    expected = {f"param_grad/norm/{n}": v for n, v in params.items()}
    expected |= {f"gradient/norm/{m}": v for m, v in outputs.items()}
    expected["param_grad/global_norm"] = expected["step/grad_norm"] = math.sqrt(sum(v * v for v in params.values()))
    for tag, value in expected.items():
        assert run.scalar(tag, at) == pytest.approx(value, rel=1e-5), tag
    assert ("exploding_gradient", at) in kinds and ("gradient_spike", at) in kinds
    assert not any(kind == "nonfinite" for kind, _ in kinds), kinds
