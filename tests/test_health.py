"""Health findings: each kind fires on a model that has the problem, names the right module,
is reported once when it starts (one log line per step), tells an architecture from a
pathology, and keeps its state across steps that carry no evidence."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_run, read_text
from models import sigmoid_stack
from torch import nn

from tblog_hooks import HookLogger, HookLoggerError, Thresholds
from tblog_hooks.cli import main
from tblog_hooks.cli.demo import run_demo
from tblog_hooks.cli.report import load
from tblog_hooks.diagnostics.health import default_health
from tblog_hooks.diagnostics.replay import findings


def test_vanishing_gradient_names_the_modules_the_gradient_has_left(tmp_path, caplog) -> None:
    model = sigmoid_stack(8, 16)
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    caplog.set_level(logging.WARNING, logger="tblog_hooks.health")
    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        for _ in range(2):
            # Reference: the same forward by hand, keeping each Linear's output gradient.
            x, outputs = torch.randn(32, 16), []
            for layer in model:
                x = layer(x)
                if isinstance(layer, nn.Linear):
                    x.retain_grad()
                    outputs.append(x)
            nn.functional.cross_entropy(x, torch.randint(0, 2, (32,))).backward()
            norms = [float(o.grad.double().norm()) for o in outputs]
            hooks.step()
        assert hooks.summary()["min_layer_grad"] == pytest.approx(min(norms), rel=1e-4)
    # Every norm from the input up to the module is below 1e-4 of the largest.
    expected = [name for i, name in enumerate(linears) if max(norms[: i + 1]) < 1e-4 * max(norms)]
    assert len(expected) >= 4  # the model shows the problem
    assert [f.module for f in hooks.findings] == expected
    assert {f.kind for f in hooks.findings} == {"vanishing_gradient"}
    assert {f.step for f in hooks.findings} == {0}  # reported when it starts, not again at step 1
    # One line for the step, with the count and the worst three (nearest the input).
    (record,) = caplog.records
    assert record.getMessage() == (
        f"tblog_hooks: step 0: vanishing_gradient in {len(expected)} modules, worst: "
        + ", ".join(f"{f.module} ({f.value:.3g})" for f in hooks.findings[:3])
        + f", +{len(expected) - 3} more"
    )
    run = read_run(tmp_path)
    assert run.scalars["health/vanishing_gradient"] == {0: len(expected), 1: len(expected)}
    assert run.scalars["health/nonfinite"] == {0: 0.0, 1: 0.0}
    table = read_text(tmp_path, "health/findings")[0]
    assert table.startswith(f"**vanishing_gradient**: {len(expected)} modules\n\n| module | since step |")
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == expected  # worst first


def _norms(**by_module: float) -> dict[str, float]:
    return {f"gradient/norm/{m}": v for m, v in by_module.items()}


def test_a_small_residual_branch_behind_a_large_trunk_is_not_vanishing() -> None:
    # ConvNeXt-like: layer scale 1e-6 makes every module inside the branches tiny, while the
    # stem and the downsampling layer before them carry the full gradient.
    order = ["stem", "b0.dw", "b0.pw", "down", "b1.dw", "b1.pw", "head"]
    scalars = _norms(stem=3.0, **{"b0.dw": 1e-7, "b0.pw": 2e-7}, down=1.0, **{"b1.dw": 3e-8, "b1.pw": 1e-7}, head=0.5)
    health = default_health(Thresholds())
    assert health.update(0, scalars, order) == []
    # The same norms with a stem that lost its gradient too: everything up to b1.pw has.
    scalars.update(_norms(stem=1e-6, down=1e-6))
    assert [f.module for f in health.update(1, scalars, order)] == ["stem", "b0.dw", "b0.pw", "down", "b1.dw", "b1.pw"]


def test_exactly_zero_evidence_waits_for_zero_steps() -> None:
    # A zero-initialised head: nothing before it gets a gradient until it has been updated once.
    order = ["body", "head"]
    health = default_health(Thresholds(zero_steps=3))
    assert health.update(0, _norms(body=0.0, head=0.5), order) == []
    assert health.update(1, _norms(body=1e-3, head=0.5), order) == []  # grown out of zero: never reported
    assert health.active == {}
    # A gradient that stays zero (units dead downstream): reported on the third logged step,
    # also when the zero turned into a tiny non-zero value on the way.
    for step, body in enumerate([0.0, 1e-9, 1e-9]):
        started = health.update(10 + step, _norms(body=body, head=0.5), order)
    assert [(f.kind, f.module, f.step) for f in started] == [("vanishing_gradient", "body", 12)]
    # A tiny but non-zero gradient from the start is reported at once.
    assert len(default_health(Thresholds()).update(0, _norms(body=1e-9, head=0.5), order)) == 1


def _activations(m: str, *, dead: float, low: float, high: float) -> dict[str, float]:
    return {
        f"activation/mean/{m}": (low + high) / 2,
        f"activation/dead_frac/{m}": dead,
        f"activation/min/{m}": low,
        f"activation/max/{m}": high,
    }


def test_dead_units_tell_a_zero_initialised_output_from_dead_units() -> None:
    order = ["conv", "bn", "relu_layer", "head"]
    step0 = {
        **_activations("conv", dead=0.0, low=-1.0, high=1.0),
        **_activations("bn", dead=1.0, low=0.0, high=0.0),  # zero-initialised weight: exactly zero
        **_activations("relu_layer", dead=0.95, low=-3.0, high=0.5),  # pre-activations below zero
        **_activations("head", dead=1.0, low=-2.0, high=-1.0),  # the output layer: skipped
    }
    health = default_health(Thresholds())
    assert [(f.module, f.value) for f in health.update(0, step0, order)] == [("relu_layer", 0.95)]
    step1 = {**step0, **_activations("bn", dead=0.1, low=-1e-3, high=1e-3)}  # updated once: alive
    assert health.update(1, step1, order) == []
    # An output that stays exactly zero is dead after all.
    health = default_health(Thresholds(zero_steps=2))
    assert health.update(0, step0, order)[0].module == "relu_layer"
    assert [f.module for f in health.update(1, step0, order)] == ["bn"]


class _WithUnusedHead(nn.Module):
    """A regression model whose watched auxiliary head never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)
        self.aux = nn.Linear(8, 3)
        with torch.no_grad():
            self.head.bias.fill_(-100.0)  # every output negative: not dead units, it is the output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))  # type: ignore[no-any-return]


def test_a_module_that_never_ran_does_not_take_the_output_layers_place(tmp_path) -> None:
    model = _WithUnusedHead()
    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        for _ in range(2):
            model(torch.randn(16, 4)).square().mean().backward()
            hooks.step()
    assert read_run(tmp_path).scalar("activation/dead_frac/head", 1) == 1.0
    assert read_text(tmp_path, "health/forward_order")[0].endswith("`head`\n3. `aux`")  # never ran: last
    assert hooks.findings == []
    assert findings(load(tmp_path, "run")) == []


def test_thresholds_are_configurable_and_validated(tmp_path) -> None:
    model = sigmoid_stack(8, 16)
    with HookLogger(model, log_dir=tmp_path, every=1, health=Thresholds(vanishing_ratio=1e-30)) as hooks:
        nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 2, (8,))).backward()
        hooks.step()
    assert hooks.findings == []
    with HookLogger(model, log_dir=tmp_path, every=1, health=None) as hooks:
        assert hooks.summary() == {}
    # numpy numbers are numbers; every rule can be switched off; whole step counts stay ints.
    t = Thresholds(vanishing_ratio=np.float32(1e-3), exploding_norm=math.inf, exploding_growth=np.int64(50))
    assert t.vanishing_ratio == pytest.approx(1e-3) and type(t.vanishing_ratio) is float
    assert t.exploding_growth == 50.0 and t.zero_steps == 3 and type(t.zero_steps) is int
    off = Thresholds(vanishing_ratio=0, exploding_update=math.inf, exploding_growth=math.inf, dead_fraction=math.inf)
    assert Thresholds(amp_skipped_steps=math.inf).amp_skipped_steps == math.inf
    dead = _activations("a", dead=1.0, low=-1, high=-1) | _activations("b", dead=0.0, low=-1, high=1)
    assert default_health(off).update(0, {**_norms(a=1e-9, b=1.0), **dead}, ["a", "b"]) == []
    assert len(default_health(Thresholds()).update(0, {**_norms(a=1e-9, b=1.0), **dead}, ["a", "b"])) == 2
    bad = [
        ("vanishing_ratio", 2.0), ("vanishing_ratio", math.nan), ("dead_fraction", 0.0), ("dead_fraction", True),
        ("exploding_growth", True), ("exploding_growth", 1.0), ("exploding_norm", "1e3"), ("zero_steps", 1.5),
        ("zero_steps", math.inf), ("amp_skipped_steps", 0), ("exploding_update", -1.0),
    ]  # fmt: skip
    for name, value in bad:
        with pytest.raises(HookLoggerError, match=rf"Thresholds\({name}={value!r}\) is invalid: it must be"):
            Thresholds(**{name: value})  # type: ignore[arg-type]
    with pytest.raises(HookLoggerError, match="health must be"):
        HookLogger(model, log_dir=tmp_path, health={"vanishing_ratio": 1e-3})  # type: ignore[arg-type]


def test_exploding_gradient_by_update_size_growth_and_size() -> None:
    order = ["a", "b"]
    # The optimizer step moved most weights by more than ten times their norm.
    ratios = {
        "param/update_ratio/a.weight": 30.0,
        "param/update_ratio/a.bias": 12.0,
        "param/update_ratio/b.weight": 0.1,
    }
    (found,) = default_health(Thresholds()).update(0, {**_norms(a=1.0, b=1.0), **ratios}, order)
    assert (found.kind, found.module, found.value) == ("exploding_gradient", "a.weight", 12.0)
    calm = {**ratios, "param/update_ratio/a.bias": 1e-3}  # median 0.1
    assert default_health(Thresholds()).update(0, {**_norms(a=1.0, b=1.0), **calm}, order) == []

    health = default_health(Thresholds(exploding_growth=100.0))
    assert health.update(0, _norms(a=2.0, b=1.0), order) == []
    assert health.update(1, _norms(a=3.0, b=1.0), order) == []
    grown = health.update(2, _norms(a=1.0, b=251.0), order)  # 251 > 100 x median(2, 3)
    assert [(f.kind, f.module, f.value) for f in grown] == [("exploding_gradient", "b", 251.0)]
    assert health.update(3, _norms(a=1.0, b=300.0), order) == []  # still going: not reported again
    assert health.counts()["health/exploding_gradient"] == 1
    assert default_health(Thresholds()).update(0, _norms(a=5e6, b=1.0), order) == []  # no absolute limit by default
    big = default_health(Thresholds(exploding_norm=1e3)).update(0, _norms(a=5e3, b=1.0), order)
    assert [(f.kind, f.module) for f in big] == [("exploding_gradient", "a")]


def test_growth_is_judged_against_a_bounded_window_of_recent_steps() -> None:
    window = 8
    health = default_health(Thresholds(exploding_growth=100.0, growth_window=window))
    for step in range(window):
        health.update(step, _norms(a=1.0), ["a"])
    for step in range(window, 2 * window):
        assert health.update(step, _norms(a=50.0), ["a"]) == []  # 50x: not a finding
    # 4000 is 80x the recent median (50), though 157x the median of the whole run (25.5).
    assert health.update(2 * window, _norms(a=4000.0), ["a"]) == []
    assert len(health.update(2 * window + 1, _norms(a=6000.0), ["a"])) == 1


def test_one_log_line_and_one_table_per_kind_worst_first(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tblog_hooks.health")
    order = ["a", "b", "c", "d", "e", "f", "g", "h"]
    scalars = _norms(a=1e-9, b=1e-8, c=1e-7, d=5e-8, e=1e-6, f=1.0, g=1.0, h=1.0)
    scalars.update(_activations("f", dead=0.92, low=-1, high=1) | _activations("g", dead=1.0, low=-2, high=-1))
    scalars.update(_activations("h", dead=0.0, low=-1, high=1))
    health = default_health(Thresholds())
    assert len(health.update(7, scalars, order)) == 7
    (record,) = caplog.records
    assert record.getMessage() == (
        "tblog_hooks: step 7: vanishing_gradient in 5 modules, worst: a (1e-09), b (1e-08), c (1e-07), +2 more; "
        "dead_units in 2 modules, worst: g (1), f (0.92)"
    )
    table = health.table()
    assert table.startswith("**vanishing_gradient**: 5 modules\n\n| module |")
    assert "\n\n**dead_units**: 2 modules\n\n| module |" in table
    assert [line.split("`")[1] for line in table.splitlines() if line.startswith("| `")] == list("abcdegf")
    caplog.clear()
    assert health.update(8, scalars, order) == [] and not caplog.records  # nothing new: no line


def test_nonfinite_origin_from_backward_when_activations_are_finite() -> None:
    scalars = {"gradient/nonfinite/a": 3.0, "gradient/nonfinite/b": 5.0, "gradient/nonfinite/c": 0.0}
    (finding,) = default_health(Thresholds()).update(0, scalars, ["a", "b", "c"])
    assert (finding.kind, finding.module, finding.value) == ("nonfinite", "b", 5.0)  # b is reached first backward


class _Reciprocal(nn.Module):
    """A watched module that turns zeros into Inf (and Inf - Inf into NaN downstream)."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain / x


def test_nonfinite_origin_is_the_first_module_whose_input_was_finite(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), _Reciprocal(), nn.Linear(4, 4), nn.Linear(4, 2))
    x0 = torch.randn(8, 4)
    x1 = x0.clone()
    x1[0, 0] = float("nan")  # step 1: bad data, no module to blame
    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        for x in (x0, x1):
            model(x).sum().backward()
            hooks.step()
    with torch.no_grad():
        zeros = int((model[1](model[0](x0)) == 0).sum())  # each becomes Inf in module 2
    assert zeros > 0
    assert [(f.kind, f.module, f.step) for f in hooks.findings] == [("nonfinite", "2", 0)]  # not 3 or 4
    run = read_run(tmp_path)
    assert run.scalar("input/nonfinite/2", 0) == 0
    assert run.scalar("activation/nonfinite/2", 0) == run.scalar("input/nonfinite/3", 0) == zeros
    assert run.scalar("health/nonfinite", 1) == 1
    # Replaying the event files finds the same; step 1 alone is blamed on the data.
    replayed = findings(load(tmp_path, "run"))
    assert [(f.kind, f.module, f.step) for f in replayed] == [("nonfinite", "2", 0)]
    scalars = {t: v[1] for t, v in run.scalars.items()}
    (data_problem,) = default_health(Thresholds()).update(1, scalars, ["0", "2", "3", "4"])
    assert data_problem.module == "0" and "check the data" in data_problem.message


def test_dead_units_in_a_relu_mlp_with_a_bad_bias(tmp_path) -> None:
    hidden = nn.Linear(8, 32)
    with torch.no_grad():
        hidden.bias[:30] = -10.0  # 30 of 32 units never fire
    model = nn.Sequential(hidden, nn.ReLU(), nn.Linear(32, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].bias.fill_(-10.0)  # all 8 dead
        model[4].bias.fill_(-10.0)  # the output layer: not reported
    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        x = torch.randn(16, 8)
        model(x).sum().backward()
        hooks.step()
    with torch.no_grad():
        dead = float((hidden(x).amax(dim=0) <= 0).double().mean())
    assert dead >= 30 / 32
    found = {f.module: f.value for f in hooks.findings if f.kind == "dead_units"}
    assert found == {"0": pytest.approx(dead), "2": 1.0}


def _amp_run(log_dir: Path, overflow: set[int], steps: int) -> tuple[HookLogger, list[dict[str, float]]]:
    """The deep sigmoid stack (vanishing on every step) under a CPU GradScaler; the steps in
    ``overflow`` overflow (as AMP calibration does) and are skipped."""
    model = sigmoid_stack(8, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    summaries = []
    with HookLogger(model, log_dir=log_dir, every=1, scaler=scaler, optimizer=opt) as hooks:
        for step in range(steps):
            loss = nn.functional.cross_entropy(model(torch.randn(32, 16)), torch.randint(0, 2, (32,)))
            scaler.scale(loss * (math.inf if step in overflow else 1.0)).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            hooks.step()
            summaries.append(hooks.summary())
    return hooks, summaries


def test_steps_the_scaler_skips_start_nothing_and_restart_nothing(tmp_path) -> None:
    hooks, summaries = _amp_run(tmp_path, overflow={0, 2}, steps=4)
    run = read_run(tmp_path)
    assert run.scalars["amp/skipped_step"] == {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0}
    assert run.scalar("gradient/nonfinite/16", 2) > 0  # the overflow is logged ...
    assert {f.kind for f in hooks.findings} == {"vanishing_gradient"}  # ... and is no finding
    assert {f.step for f in hooks.findings} == {1}  # judged on the first step with gradients, kept over step 2
    count = run.scalars["health/vanishing_gradient"]
    assert count[0] == 0 and count[1] == count[2] == count[3] > 0
    assert "grad_norm" not in summaries[0]
    assert summaries[2]["grad_norm"] == summaries[1]["grad_norm"]  # the skipped step keeps the last one
    assert summaries[3]["grad_norm"] != summaries[1]["grad_norm"]
    replayed = findings(load(tmp_path, "run"))
    assert [(f.kind, f.module, f.step) for f in replayed] == [(f.kind, f.module, f.step) for f in hooks.findings]
    assert main(["report", str(tmp_path), "--fail-on", "nonfinite,amp_skipped_steps"]) == 0  # a CI gate passes


def test_a_scaler_that_keeps_skipping_is_a_finding(tmp_path) -> None:
    thresholds = Thresholds(amp_skipped_steps=3)
    health = default_health(thresholds)
    skipped = {"amp/skipped_step": 1.0, "amp/loss_scale": 2.0**-5, "gradient/nonfinite/a": 4.0}
    fine = {"amp/skipped_step": 0.0, "amp/loss_scale": 1.0, **_norms(a=1.0)}
    assert health.update(0, skipped, ["a"]) == health.update(1, skipped, ["a"]) == []
    assert health.update(2, fine, ["a"]) == []  # not in a row
    assert health.update(3, skipped, ["a"]) == health.update(4, skipped, ["a"]) == []
    (found,) = health.update(5, skipped, ["a"])
    assert (found.kind, found.module, found.value) == ("amp_skipped_steps", "", 3.0)
    assert "skipped the last 3 logged steps" in found.message and "0.0312" in found.message
    assert health.update(6, fine, ["a"]) == [] and health.active == {}
    # The default: 20 logged steps in a row, as the report replays with.
    default = default_health(Thresholds())
    assert [len(default.update(step, skipped, ["a"])) for step in range(20)] == [0] * 19 + [1]


@pytest.mark.parametrize(
    ("scenario", "steps", "first"),
    [
        # every=10, as the demo runs by default: the logged step (and module) each is first reported at
        ("vanishing", 11, {"vanishing_gradient": (0, "0")}),
        ("exploding", 11, {"exploding_gradient": (0, "14.weight"), "nonfinite": (10, "0")}),
        ("dead-relu", 21, {"dead_units": (0, "0"), "vanishing_gradient": (20, "0")}),
        ("nan", 31, {"nonfinite": (30, "normalize")}),
    ],
)
def test_each_demo_scenario_shows_its_finding(tmp_path, scenario: str, steps: int, first: dict) -> None:
    run_dir = run_demo(tmp_path, scenario, steps, 10, torch.device("cpu"))
    found: dict[str, tuple[int, str]] = {}
    for f in findings(load(run_dir, scenario)):
        found.setdefault(f.kind, (f.step, f.module))
    assert found == first
