"""Health findings: each kind fires on a model that has the problem, names the right module,
is reported once when it starts, and stays quiet on healthy training."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from conftest import read_run, read_text
from torch import nn

from tblog_hooks import HookLogger, HookLoggerError, Thresholds
from tblog_hooks.demo import run_demo
from tblog_hooks.health import KINDS, Health
from tblog_hooks.report import findings, load


def _deep_sigmoid() -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(16, 16), nn.Sigmoid()]
    return nn.Sequential(*layers, nn.Linear(16, 2))


def test_vanishing_gradient_names_the_modules_far_below_the_largest(tmp_path, caplog) -> None:
    model = _deep_sigmoid()
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
    expected = {name for name, n in zip(linears, norms) if n < 1e-4 * max(norms)}
    assert len(expected) >= 2  # the model shows the problem
    assert {f.module for f in hooks.findings} == expected
    assert {f.kind for f in hooks.findings} == {"vanishing_gradient"}
    assert {f.step for f in hooks.findings} == {0}  # reported when it starts, not again at step 1
    assert sorted(re.search(r"norm of (\S+) is", r.getMessage())[1] for r in caplog.records) == sorted(expected)
    run = read_run(tmp_path)
    assert run.scalars["health/vanishing_gradient"] == {0: len(expected), 1: len(expected)}
    assert run.scalars["health/nonfinite"] == {0: 0.0, 1: 0.0}
    table = read_text(tmp_path, "health/findings")[0]
    assert table.startswith("| finding | module |") and all(f"| `{m}` |" in table for m in expected)


def test_thresholds_are_configurable_and_validated(tmp_path) -> None:
    model = _deep_sigmoid()
    with HookLogger(model, log_dir=tmp_path, every=1, health=Thresholds(vanishing_ratio=1e-30)) as hooks:
        nn.functional.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 2, (8,))).backward()
        hooks.step()
    assert hooks.findings == []
    with HookLogger(model, log_dir=tmp_path, every=1, health=None) as hooks:
        assert hooks.summary() == {}
    for bad in ({"vanishing_ratio": 2.0}, {"dead_fraction": 0.0}, {"exploding_growth": True}):
        with pytest.raises(HookLoggerError, match=next(iter(bad))):
            Thresholds(**bad)  # type: ignore[arg-type]
    with pytest.raises(HookLoggerError, match="health must be"):
        HookLogger(model, log_dir=tmp_path, health={"vanishing_ratio": 1e-3})  # type: ignore[arg-type]


def _norms(**by_module: float) -> dict[str, float]:
    return {f"gradient/norm/{m}": v for m, v in by_module.items()}


def test_exploding_gradient_by_size_and_by_growth() -> None:
    health = Health(Thresholds(exploding_norm=1e3, exploding_growth=100.0))
    order = ["a", "b"]
    assert health.update(0, _norms(a=2.0, b=1.0), order) == []
    assert health.update(1, _norms(a=3.0, b=1.0), order) == []
    grown = health.update(2, _norms(a=1.0, b=251.0), order)  # 251 > 100 x median(2, 3)
    assert [(f.kind, f.module, f.value) for f in grown] == [("exploding_gradient", "b", 251.0)]
    assert health.update(3, _norms(a=1.0, b=300.0), order) == []  # still going: not reported again
    assert health.counts()["health/exploding_gradient"] == 1
    big = Health(Thresholds()).update(0, _norms(a=5e3, b=1.0), order)
    assert [(f.kind, f.module) for f in big] == [("exploding_gradient", "a")]


def test_nonfinite_origin_from_backward_when_activations_are_finite() -> None:
    scalars = {"gradient/nonfinite/a": 3.0, "gradient/nonfinite/b": 5.0, "gradient/nonfinite/c": 0.0}
    (finding,) = Health(Thresholds()).update(0, scalars, ["a", "b", "c"])
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
    (data_problem,) = Health(Thresholds()).update(1, {t: v[1] for t, v in run.scalars.items()}, ["0", "2", "3", "4"])
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


@pytest.mark.parametrize(
    ("scenario", "steps", "every", "kinds"),
    [
        ("vanishing", 1, 1, {"vanishing_gradient"}),
        ("exploding", 1, 1, {"exploding_gradient"}),
        ("dead-relu", 1, 1, {"dead_units", "vanishing_gradient"}),
        ("nan", 31, 30, {"nonfinite"}),
    ],
)
def test_each_demo_scenario_shows_its_finding(tmp_path, scenario: str, steps: int, every: int, kinds: set[str]) -> None:
    run_dir = run_demo(tmp_path, scenario, steps, every, torch.device("cpu"))
    found = findings(load(run_dir, scenario))
    assert {f.kind for f in found} == kinds
    if scenario == "nan":
        assert [(f.module, f.step) for f in found] == [("normalize", 30)]


def test_all_kinds_are_documented() -> None:
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert all(f"`{kind}`" in readme for kind in KINDS)
