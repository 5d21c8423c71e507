"""``spikes=``: every step's gradient norm and loss, spikes between logged steps found at their step,
attributed to a module, the steps after them logged in full, at a fixed handful of ops per step."""

from __future__ import annotations

import json
import math
from collections import Counter, deque
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import OpCounter, needs_cuda, read_run, spawn_ranks
from models import conv_net, gpt2, mlp, optimizer_step, timm_model
from torch import nn

from tblog_hooks import HookLogger, HookLoggerError, Spikes
from tblog_hooks.cli import main, report

SPIKE_KINDS = ("gradient_spike", "loss_spike")


def _teacher(dim: int = 16, classes: int = 4, batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of a fixed linear teacher's task (the same teacher every call: seeded)."""
    w = torch.Generator().manual_seed(1)
    teacher = torch.randn(dim, classes, generator=w)
    x = torch.randn(batch, dim)
    return x, (x @ teacher).argmax(1)


def _module_norms(model: nn.Module, modules: list[str]) -> dict[str, float]:
    """Each module's own parameter-gradient norm, in float64 (the reference)."""
    out = {}
    for m in modules:
        grads = [p.grad.double().flatten() for p in model.get_submodule(m).parameters(recurse=False)]
        out[m] = torch.linalg.vector_norm(torch.cat(grads)).item()
    return out


def _spike_run(
    log_dir: Path,
    *,
    at: int,
    scale: float,
    param: str,
    steps: int = 120,
    every: int = 50,
    recording: list[int] | None = None,
) -> tuple:
    """An MLP trained with AdamW, ``param``'s gradient scaled by ``scale`` at step ``at``; the true
    global and per-module norms of every step, and the losses (and into ``recording`` the steps
    ``hooks.recording`` was true for before their forward)."""
    model = mlp(16, 32, 32, 32, 4, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    truth: dict[int, float] = {}
    modules: dict[int, dict[str, float]] = {}
    losses: dict[int, float] = {}
    with HookLogger(model, log_dir=log_dir, every=every, optimizer=opt, spikes=True) as hooks:
        for step in range(steps):
            if hooks.recording and recording is not None:
                recording.append(step)
            loss = nn.functional.cross_entropy(model(_teacher()[0]), _teacher()[1])
            loss.backward()
            if step == at:
                model.get_parameter(param).grad.mul_(scale)
            grads = torch.cat([p.grad.double().flatten() for p in model.parameters()])
            truth[step] = torch.linalg.vector_norm(grads).item()
            modules[step] = _module_norms(model, list(hooks.module_names))
            losses[step] = loss.item()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
        findings = hooks.findings
    return findings, truth, modules, losses


def test_injected_gradient_spike_is_found_at_its_step_in_its_module_and_logged_around(tmp_path) -> None:
    recording: list[int] = []
    findings, truth, modules, losses = _spike_run(tmp_path, at=77, scale=100.0, param="4.weight", recording=recording)
    spikes = [f for f in findings if f.kind in SPIKE_KINDS]
    assert [(f.kind, f.step, f.module) for f in spikes] == [("gradient_spike", 77, "4")]
    assert "then" in spikes[0].message and "0 (" in spikes[0].message  # the runners-up are named
    assert spikes[0].value == pytest.approx(truth[77] / sorted(truth[s] for s in range(0, 77))[38], rel=0.5)

    run = read_run(tmp_path)
    # Every step's global norm and loss at its own step, equal to the true ones.
    grad_norm, loss = run.scalars["step/grad_norm"], run.scalars["step/loss"]
    assert sorted(grad_norm) == sorted(loss) == list(range(120))
    for step, norm in truth.items():
        assert grad_norm[step] == pytest.approx(norm, rel=1e-4), step
        assert loss[step] == pytest.approx(losses[step], rel=1e-6)
    # The three steps after the spike are logged in full (every histogram), besides 0, 50, 100.
    assert sorted(run.scalars["param_grad/global_norm"]) == recording == [0, 50, 78, 79, 80, 100]
    assert 78 in run.histograms["activation/0"] and 78 in run.histograms["param/0.weight"]
    assert run.scalars["health/gradient_spike"] == {0: 0.0, 50: 0.0, 78: 1.0, 79: 0.0, 80: 0.0, 100: 0.0}
    # The per-module norms of the 64 steps up to the spike and of the three after it.
    for m in ("0", "2", "4", "6"):
        series = run.scalars[f"spike/grad_norm/{m}"]
        assert sorted(series) == list(range(77 - 63, 81))
        for step, value in series.items():
            assert value == pytest.approx(modules[step][m], rel=1e-4)


def test_report_lists_the_spikes_and_fails_on_them(tmp_path, capsys) -> None:
    spiked, healthy = tmp_path / "spiked", tmp_path / "healthy"
    findings, *_ = _spike_run(spiked, at=60, scale=30.0, param="2.weight", steps=80)
    _spike_run(healthy, at=-1, scale=1.0, param="2.weight", steps=80)
    # The report replays the written series through the same detector: the same findings.
    (run,) = report.load_all(spiked, "spiked")
    spikes = [f for f in findings if f.kind in SPIKE_KINDS]
    assert [(f.kind, f.step, f.module) for f in spikes] == [("gradient_spike", 60, "2")]
    assert [f for f in report.findings(run) if f.kind in SPIKE_KINDS] == spikes
    assert main(["report", str(spiked), "--fail-on", "gradient_spike"]) == 1
    assert "step 60: gradient_spike [2] gradient norm" in capsys.readouterr().out
    assert main(["report", str(healthy), "--fail-on", "gradient_spike,loss_spike"]) == 0
    assert "spike" not in capsys.readouterr().out


def _nonfinite_run(log_dir: Path, *, at: int, inject: str, steps: int = 80, fused_scaler: bool = False) -> list:
    """An MLP trained with AdamW (no GradScaler unless ``fused_scaler``); at step ``at``, an Inf in
    the gradient of one weight (``inject="param"``: module 4's) or in the gradient flowing back into
    module 4's output (``"backward"``: modules 4, 2 and 0 get non-finite gradients)."""
    model = mlp(16, 32, 32, 32, 4, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=fused_scaler or None)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0) if fused_scaler else None
    with HookLogger(model, log_dir=log_dir, every=50, optimizer=opt, spikes=True, scaler=scaler) as hooks:
        for step in range(steps):
            x, y = _teacher()
            out = model[:5](x)
            if step == at and inject == "backward":
                out.register_hook(lambda g: g * math.inf)
            loss = nn.functional.cross_entropy(model[5:](out), y)
            (loss if scaler is None else scaler.scale(loss)).backward()
            if step == at and inject == "param":
                model[4].weight.grad[0, 0] = math.inf
            optimizer_step(opt, scaler)
            hooks.step(loss=loss)
        return hooks.findings


@pytest.mark.parametrize(("inject", "first"), [("param", "4"), ("backward", "0")])
def test_nonfinite_gradient_between_logged_steps_is_found_at_its_step(
    tmp_path, capsys, inject: str, first: str
) -> None:
    """No GradScaler: the Inf reaches the weights, which are NaN from then on. ``nonfinite`` starts at
    the step of the Inf, naming the first module in forward order whose gradient is not finite; every
    series goes on."""
    findings = _nonfinite_run(tmp_path, at=37, inject=inject)
    per_step = [f for f in findings if f.step <= 37]  # (the steps after it are logged in full: NaN outputs)
    assert [(f.kind, f.step, f.module) for f in per_step] == [("nonfinite", 37, first)]
    assert not math.isfinite(per_step[0].value)
    if inject == "backward":
        assert "(then 2, 4)" in per_step[0].message
    run = read_run(tmp_path)
    grad_norm, loss = run.scalars["step/grad_norm"], run.scalars["step/loss"]
    assert sorted(grad_norm) == sorted(loss) == list(range(80))
    assert all(math.isfinite(grad_norm[s]) for s in range(37)) and not any(
        math.isfinite(grad_norm[s]) for s in range(37, 80)
    )
    assert math.isfinite(loss[37]) and math.isnan(loss[38])  # (the step after: the weights are NaN)
    assert not math.isfinite(run.scalars[f"spike/grad_norm/{first}"][37])
    assert math.isfinite(run.scalars["spike/grad_norm/6"][37])  # (the module after the Inf)
    # The report replays the series: the same finding, at its step.
    (loaded,) = report.load_all(tmp_path, "run")
    replayed = [(f.kind, f.step, f.module, f.message) for f in report.findings(loaded) if f.step <= 37]
    assert replayed == [(f.kind, f.step, f.module, f.message) for f in per_step]
    assert main(["report", str(tmp_path), "--fail-on", "nonfinite"]) == 1
    assert f"step 37: nonfinite [{first}]" in capsys.readouterr().out


def test_a_step_the_scaler_skips_is_no_nonfinite_finding(tmp_path) -> None:
    """A fused optimizer's step runs on the scaler's overflow (and skips itself): its inf gradients
    are not read, the weights stay finite, nothing is found."""
    findings = _nonfinite_run(tmp_path, at=37, inject="param", fused_scaler=True)
    assert [f for f in findings if f.kind in (*SPIKE_KINDS, "nonfinite")] == []
    grad_norm = read_run(tmp_path).scalars["step/grad_norm"]
    assert sorted(grad_norm) == [s for s in range(80) if s != 37]
    assert all(math.isfinite(v) for v in grad_norm.values())


def _gpt2(layers: int) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=layers, n_head=2)
    return transformers.GPT2LMHeadModel(config)


ONE_MODULE = {  # model, its loss, the parameters whose gradients are scaled, the factor, the module expected
    "mlp-8-layers": (
        lambda: mlp(1024, *[32] * 7, 4, seed=0),
        lambda m: _teacher_loss(m, dim=1024, batch=256), ["8.weight", "8.bias"], 30.0, "8",
    ),
    "gpt2-4-layers": (
        lambda: _gpt2(4),
        lambda m: _language_loss(m), ["transformer.h.2.ln_2.weight", "transformer.h.2.ln_2.bias"], 50.0,
        "transformer.h.2.ln_2",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ONE_MODULE)
def test_a_spike_in_one_module_is_found_where_the_global_norm_barely_moves(tmp_path, case: str) -> None:
    """Each watched module's own norm is judged against its own history (by a stricter bar): a
    module whose gradient jumps 30-50x starts gradient_spike naming it, while the global norm rises
    less than grad_ratio."""
    build, loss_of, params, factor, expected = ONE_MODULE[case]
    torch.manual_seed(0)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    at, totals = 120, []
    with HookLogger(model, log_dir=tmp_path, every=1000, optimizer=opt, spikes=True) as hooks:
        for step in range(at + 10):
            loss = loss_of(model)
            loss.backward()
            if step == at:
                for name in params:
                    model.get_parameter(name).grad.mul_(factor)
            totals.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item())
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
        spikes = [f for f in hooks.findings if f.kind in SPIKE_KINDS]
    assert totals[at] < 3 * sorted(totals[:at])[at // 2]  # the global norm stays under grad_ratio
    assert [(f.kind, f.step, f.module) for f in spikes] == [("gradient_spike", at, expected)]
    assert spikes[0].value > 10 and f"the gradient norm of {expected} is" in spikes[0].message
    (run,) = report.load_all(tmp_path, "run")
    replayed = [(f.kind, f.step, f.module) for f in report.findings(run) if f.kind in SPIKE_KINDS]
    assert replayed == [("gradient_spike", at, expected)]


def test_report_of_a_resumed_run_leaves_out_what_tensorboard_purged(tmp_path) -> None:
    """A run with a spike at 175 crashed at 200 and resumed at step 100 (start_step, a purge in
    TensorBoard's terms) is now at 160: the report reads the run as TensorBoard shows it."""
    findings, *_ = _spike_run(tmp_path, at=175, scale=100.0, param="4.weight", steps=200)
    assert [(f.kind, f.step) for f in findings if f.kind in SPIKE_KINDS] == [("gradient_spike", 175)]
    model = mlp(16, 32, 32, 32, 4, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with HookLogger(model, log_dir=tmp_path, every=50, optimizer=opt, spikes=True, start_step=100) as hooks:
        for _ in range(60):
            loss = nn.functional.cross_entropy(model(_teacher()[0]), _teacher()[1])
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
    shown = read_run(tmp_path).scalars  # TensorBoard's EventAccumulator (purge_orphaned_data)
    (run,) = report.load_all(tmp_path, "run")
    assert sorted(run.series) == sorted(shown["step/grad_norm"]) == list(range(160))
    assert list(run.scalars) == sorted(shown["param_grad/global_norm"]) == [0, 50, 100, 150]
    assert [f for f in report.findings(run) if f.kind in SPIKE_KINDS] == []
    assert main(["report", str(tmp_path), "--fail-on", "gradient_spike"]) == 0


def test_a_one_sample_last_batch_is_not_judged(tmp_path) -> None:
    """DataLoader(drop_last=False) over 65 samples in batches of 32: each epoch ends with a batch of
    one sample, whose gradient is mostly noise. Such a step (under half the usual batch) is written
    but not judged; a spike in a full batch is still found."""
    x, y = _teacher(batch=65)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    torch.manual_seed(0)
    model = mlp(16, 32, 32, 32, 4, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    step, spiked = 0, 0
    with HookLogger(model, log_dir=tmp_path, every=1000, optimizer=opt, spikes=True) as hooks:
        for _ in range(40):
            for xb, yb in loader:
                loss = nn.functional.cross_entropy(model(xb), yb)
                loss.backward()
                if step == 100:
                    assert len(xb) == 32
                    spiked = step
                    model[2].weight.grad.mul_(100)
                opt.step()
                opt.zero_grad()
                hooks.step(loss=loss)
                step += 1
        spikes = [(f.kind, f.step, f.module) for f in hooks.findings if f.kind in SPIKE_KINDS]
    assert spikes == [("gradient_spike", spiked, "2")]
    samples = read_run(tmp_path).scalars["step/samples"]
    assert samples == {s: 1.0 if s % 3 == 2 else 32.0 for s in range(120)}
    (run,) = report.load_all(tmp_path, "run")  # the report judges the steps the logger judged
    assert [(f.kind, f.step, f.module) for f in report.findings(run) if f.kind in SPIKE_KINDS] == spikes


def test_the_report_judges_a_small_batch_as_the_live_logger(tmp_path, capsys) -> None:
    """A one-sample batch right after a spike, inside the stretch of written per-module norms, then
    a spike of one module's own norm: the report goes on judging the stretch through the small
    batch, as the live logger does, and finds what it found."""
    model = mlp(16, 32, 32, 32, 4, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with HookLogger(model, log_dir=tmp_path, every=1000, optimizer=opt, spikes=True) as hooks:
        for step in range(70):
            x, y = _teacher(batch=1 if step == 61 else 32)
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            if step == 60:
                model[2].weight.grad.mul_(100)  # a spike: the 64 steps before it and 3 after are written
            if step == 62:
                model[0].bias.grad.mul_(300)  # its module's own norm spikes, the global one barely moves
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
        live = hooks.findings
    assert [(f.kind, f.step, f.module) for f in live] == [("gradient_spike", 60, "2"), ("gradient_spike", 62, "0")]
    assert read_run(tmp_path).scalars["step/samples"][61] == 1.0
    assert main(["report", "--json", str(tmp_path)]) == 0
    document = json.loads(capsys.readouterr().out)
    replayed = document["findings"]
    assert [(f["kind"], f["step"], f["module"]) for f in replayed] == [(f.kind, f.step, f.module) for f in live]
    assert [f["value"] for f in replayed] == pytest.approx([f.value for f in live], rel=1e-5)


def test_loss_spike_without_optimizer_given(tmp_path) -> None:
    """The pre-hook fires for every torch.optim optimizer: norms are read without optimizer= too."""
    model = mlp(16, 32, 4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = {}
    with HookLogger(model, log_dir=tmp_path, every=1000, spikes=True) as hooks:
        for step in range(70):
            loss = nn.functional.cross_entropy(model(_teacher()[0]), _teacher()[1])
            if step == 55:
                loss = loss * 5  # (the loss, and so every gradient, five times larger)
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
            losses[step] = loss.item()
        spikes = [(f.kind, f.step) for f in hooks.findings if f.kind in SPIKE_KINDS]
    assert spikes == [("gradient_spike", 55), ("loss_spike", 55)]
    assert read_run(tmp_path).scalars["step/loss"] == pytest.approx(losses, rel=1e-6)


def test_loss_alone_without_any_torch_optim_optimizer(tmp_path) -> None:
    model = mlp(16, 32, 4, seed=0)
    with HookLogger(model, log_dir=tmp_path, every=1000, spikes=True) as hooks:
        for step in range(60):
            loss = nn.functional.cross_entropy(model(_teacher()[0]), _teacher()[1]) * (4 if step == 40 else 1)
            loss.backward()
            with torch.no_grad():  # a hand-written update: no optimizer step pre-hook
                for p in model.parameters():
                    p -= 0.05 * p.grad
                    p.grad = None
            hooks.step(loss=loss.item())  # a number is a loss too
        spikes = [(f.kind, f.step, f.module) for f in hooks.findings if f.kind in SPIKE_KINDS]
    assert spikes == [("loss_spike", 40, "")]
    run = read_run(tmp_path)
    assert "step/grad_norm" not in run.scalars and sorted(run.scalars["step/loss"]) == list(range(60))


def _largest_container(log: object) -> int:
    """The most entries any list, dict, set or deque of a spike log (and of its parts) holds."""
    parts = [log, getattr(log, "norms", None), getattr(log, "watch", None)]
    sizes = [
        len(v)
        for part in parts
        if part is not None
        for v in vars(part).values()
        if isinstance(v, (list, dict, set, deque))
    ]
    return max(sizes, default=0)


class _HandWritten:
    """An optimizer that is no torch.optim.Optimizer: its step fires no optimizer step hook."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params

    def step(self) -> None:
        with torch.no_grad():
            for p in self.params:
                p -= 0.05 * p.grad
                p.grad = None


def test_nothing_to_judge_holds_nothing_and_is_said_once(tmp_path) -> None:
    model = mlp(16, 32, 4, seed=0)
    opt = _HandWritten(list(model.parameters()))
    said_once = r"nothing to judge for 20 steps: no torch\.optim optimizer .*hooks\.step\(loss=loss\)"
    with (
        pytest.warns(UserWarning, match=said_once) as said,
        HookLogger(model, log_dir=tmp_path, every=1000, spikes=True) as hooks,
    ):
        for _ in range(400):
            nn.functional.cross_entropy(model(_teacher()[0]), _teacher()[1]).backward()
            opt.step()
            hooks.step()  # no loss
        assert _largest_container(hooks._spikes) < 100
    assert len([w for w in said if "nothing to judge" in str(w.message)]) == 1
    assert _largest_container(hooks._spikes) < 100


def test_after_the_norms_fail_nothing_is_held(tmp_path, monkeypatch) -> None:
    from tblog_hooks.capture.spikes import StepNorms

    def broken(*args: object) -> None:
        raise RuntimeError("a broken norm")

    monkeypatch.setattr(StepNorms, "_squares", broken)
    model = mlp(16, 32, 4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with (
        pytest.warns(RuntimeWarning, match="reading the per-step gradient norms failed"),
        HookLogger(model, log_dir=tmp_path, every=1000, spikes=True) as hooks,
    ):
        for _ in range(400):
            nn.functional.cross_entropy(model(_teacher()[0]), _teacher()[1]).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    assert _largest_container(hooks._spikes) < 100


# -- quiet on healthy runs ------------------------------------------------------------------------
def _warm_up(opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / steps))


def _images(size: int, classes: int, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    prototypes = torch.randn(classes, 3, size, size, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, classes, (batch,))
    return prototypes[y] + torch.randn(batch, 3, size, size), y


def _tokens(vocab: int = 64) -> torch.Tensor:
    start = torch.randint(0, vocab, (8, 1))
    return (start + torch.arange(16) * torch.randint(1, 3, (8, 1))) % vocab


HEALTHY = {
    "cnn-sgd-momentum-warm-up": lambda: (conv_net(8, batch_norm=True), "sgd", 30, None, lambda m: _classify(m, 8, 3)),
    "gpt2-adamw-clipped": lambda: (gpt2(32, 64), "adamw", 20, 1.0, _language_loss),
    "vit-adamw-warm-up": lambda: (
        timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2),
        "adamw", 20, None, lambda m: _classify(m, 32, 10),
    ),
    "mlp-relu-adamw-no-warm-up": lambda: (mlp(16, 64, 64, 64, 4, act=nn.ReLU), "adamw", 0, None, _teacher_loss),
}  # fmt: skip


def _classify(model: nn.Module, size: int, classes: int) -> torch.Tensor:
    x, y = _images(size, classes)
    return nn.functional.cross_entropy(model(x), y)


def _language_loss(model: nn.Module) -> torch.Tensor:
    tokens = _tokens()
    return model(input_ids=tokens, labels=tokens).loss  # type: ignore[no-any-return]


def _teacher_loss(model: nn.Module, dim: int = 16, batch: int = 32) -> torch.Tensor:
    x, y = _teacher(dim, batch=batch)
    return nn.functional.cross_entropy(model(x), y)


@pytest.mark.parametrize("case", HEALTHY)
def test_quiet_on_healthy_runs_from_their_first_steps(tmp_path, case: str) -> None:
    model, kind, warm, clip, loss_of = HEALTHY[case]()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        if kind == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=1e-3)
    )
    schedule = _warm_up(opt, warm) if warm else None
    steps = 200 if case.startswith(("gpt2", "vit")) else 300
    with HookLogger(model, log_dir=tmp_path, every=1000, optimizer=opt, spikes=True) as hooks:
        for _ in range(steps):
            loss = loss_of(model)
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
            if schedule is not None:
                schedule.step()
            hooks.step(loss=loss)
        spikes = [f for f in hooks.findings if f.kind in SPIKE_KINDS]
    assert spikes == []
    assert len(read_run(tmp_path).scalars["step/grad_norm"]) == steps


# -- cost -------------------------------------------------------------------------------------------


def _ops_of_a_step(tmp_path: Path, depth: int, spikes: bool) -> Counter[str]:
    """The aten ops of one non-logged training step (forward, backward, optimizer step, step())."""
    model = mlp(16, *[32] * depth, 4, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HookLogger(model, log_dir=tmp_path / f"{depth}-{spikes}", every=1000, optimizer=opt, spikes=spikes) as hooks:

        def train_step() -> None:
            loss = nn.functional.cross_entropy(model(_teacher()[0]), _teacher()[1])
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss if spikes else None)

        for _ in range(3):  # step 0 is logged; the ring and index tensors are made once
            train_step()
        x_y = _teacher()  # (its ops are the same either way: made outside the count)
        with OpCounter() as counted:
            loss = nn.functional.cross_entropy(model(x_y[0]), x_y[1])
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss if spikes else None)
    return counted.ops


def test_a_non_logged_step_adds_a_handful_of_ops_whatever_the_model_size(tmp_path) -> None:
    added = {}
    for depth in (2, 12):
        plain, watched = _ops_of_a_step(tmp_path, depth, False), _ops_of_a_step(tmp_path, depth, True)
        added[depth] = watched - plain
        assert plain - watched == Counter()
    assert added[2] == added[12]
    assert "aten._local_scalar_dense" not in added[2], added[2]  # nothing read on the host
    assert sum(added[2].values()) <= 12, added[2]


# -- options and bad input ---------------------------------------------------------------------------
def test_bad_spikes_options_and_losses_are_clear_errors(tmp_path) -> None:
    model = mlp(4, 4, seed=0)
    with pytest.raises(HookLoggerError, match=r"spikes must be True, a tblog_hooks\.Spikes, or False or None.*'yes'"):
        HookLogger(model, log_dir=tmp_path, spikes="yes")
    with pytest.raises(HookLoggerError, match=r"Spikes\(window=2\) is invalid: it must be a whole number of optimizer"):
        Spikes(window=2)
    with pytest.raises(HookLoggerError, match=r"Spikes\(grad_ratio=0.5\) is invalid"):
        Spikes(grad_ratio=0.5)
    with pytest.raises(HookLoggerError, match=r"warmup=50\) is larger than window=40"):
        Spikes(window=40, warmup=50)
    one_element = r"one-element floating-point tensor .* got a tensor of shape \(3,\)"
    with (
        HookLogger(model, log_dir=tmp_path, spikes=Spikes(steps=8)) as hooks,
        pytest.raises(HookLoggerError, match=one_element),
    ):
        hooks.step(loss=torch.ones(3))
    off = HookLogger(model, log_dir=tmp_path / "off")
    with off, pytest.warns(UserWarning, match="only used with spikes="):
        off.step(loss=torch.tensor(1.0))


# -- several processes -------------------------------------------------------------------------------
def _ranks_worker(rank: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    for kind in ("ddp", "fsdp2"):
        model = mlp(8, 16, 16, 4, seed=0)
        if kind == "ddp":
            wrapped: nn.Module = nn.parallel.DistributedDataParallel(model)
        else:
            for layer in (model[0], model[2], model[4]):
                fully_shard(layer)
            wrapped = fully_shard(model)
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
        log_dir = Path(root) / kind
        truths = []
        with HookLogger(wrapped, log_dir=log_dir, every=3, optimizer=opt, spikes=Spikes(warmup=3, window=8)) as hooks:
            for step in range(5):
                torch.manual_seed(100 * step + rank)  # each rank its own batch
                x, y = torch.randn(8, 8), torch.randint(0, 4, (8,))
                nn.functional.cross_entropy(wrapped(x), y).backward()
                grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in wrapped.parameters()]
                truths.append(torch.linalg.vector_norm(torch.cat([g.double().flatten() for g in grads])).item())
                opt.step()
                opt.zero_grad()
                hooks.step()
        if rank == 0:
            written = read_run(log_dir).scalars["step/grad_norm"]
            assert sorted(written) == list(range(5)), kind
            for step, truth in enumerate(truths):
                assert written[step] == pytest.approx(truth, rel=1e-4), (kind, step)
        dist.barrier()


def test_ddp_and_fsdp2_norms_are_the_whole_ones(tmp_path) -> None:
    spawn_ranks(_ranks_worker, tmp_path, 2)


def test_spikes_off_by_default_writes_no_series(tmp_path) -> None:
    model = mlp(4, 4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=tmp_path, every=2, optimizer=opt) as hooks:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    assert not any(t.startswith(("step/", "spike/")) for t in read_run(tmp_path).scalars)
    assert math.isfinite(read_run(tmp_path).scalar("param_grad/global_norm", 2))


# -- framework callbacks -----------------------------------------------------------------------------
@pytest.mark.parametrize("accumulate", [1, 2, 3])
def test_lightning_callback_passes_each_steps_loss(tmp_path, accumulate: int) -> None:
    """The step's loss is the training_step loss (the mean over its micro-batches under accumulation:
    Lightning hands on each divided by accumulate_grad_batches)."""
    pl = pytest.importorskip("lightning.pytorch")
    from models import lightning_trainer

    from tblog_hooks.integrations.lightning import HookLoggerCallback

    losses: list[float] = []

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(4, 8, 1, act=nn.ReLU, seed=0)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
            loss = (self.net(batch[0]) - batch[1]).pow(2).mean()
            losses.append(loss.item())
            return {"loss": loss}

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    data = torch.utils.data.TensorDataset(torch.randn(24, 4), torch.randn(24, 1))
    callback = HookLoggerCallback(spikes=True, every=4)
    trainer = lightning_trainer(tmp_path, [callback], accumulate_grad_batches=accumulate)
    trainer.fit(Net(), torch.utils.data.DataLoader(data, batch_size=2))
    run = read_run(trainer.logger.log_dir)
    steps = 12 // accumulate
    means = {s: sum(losses[s * accumulate : (s + 1) * accumulate]) / accumulate for s in range(steps)}
    assert run.scalars["step/loss"] == pytest.approx(means, rel=1e-6)
    assert sorted(run.scalars["step/grad_norm"]) == list(range(steps))


@pytest.mark.parametrize(("accumulate", "loss_keywords"), [(1, False), (2, False), (3, True)])
def test_transformers_callback_passes_the_trainers_own_loss(tmp_path, accumulate: int, loss_keywords: bool) -> None:
    """step/loss is the Trainer's own train/loss (logging_steps=1), under gradient accumulation too:
    the Trainer divides a model's loss by the micro-batches, unless the model takes loss keywords and
    divides by the step's num_items_in_batch."""
    transformers = pytest.importorskip("transformers")
    from tblog_hooks.integrations.transformers import HookLoggerCallback

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp(4, 8, 1, act=nn.ReLU, seed=0)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.net(x) - labels).pow(2).mean()}

    class PerItem(Net):
        def forward(self, x: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> dict[str, torch.Tensor]:
            items = kwargs.get("num_items_in_batch")
            assert items is not None  # (the Trainer passes it to a model taking loss keywords)
            return {"loss": (self.net(x) - labels).pow(2).sum() / items}

    class Samples(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.x, self.y = torch.randn(24, 4), torch.randn(24, 1)

        def __len__(self) -> int:
            return 24

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": self.x[i], "labels": self.y[i]}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, num_train_epochs=1, learning_rate=0.05,
        save_strategy="no", use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, report_to=["tensorboard"],
        logging_steps=1, gradient_accumulation_steps=accumulate,
    )  # fmt: skip
    callback = HookLoggerCallback(spikes=True, every=4)
    model = PerItem() if loss_keywords else Net()
    transformers.Trainer(model=model, args=args, train_dataset=Samples(), callbacks=[callback]).train()
    (run_dir,) = (tmp_path / "runs").iterdir()
    run = read_run(run_dir)
    # The Trainer shows its optimizer steps at 1..steps, as the callback does.
    own = run.scalars["train/loss"]
    assert sorted(own) == list(range(1, 12 // accumulate + 1))
    assert run.scalars["step/loss"] == pytest.approx(own, rel=1e-5)
    assert callback.hooks is None  # closed, its loss hook removed


class _LateRows:
    """Per-step rows that reach the host two steps late, as a CUDA copy's may (``StepNorms``' part
    that ``SpikeLog`` uses)."""

    def __init__(self, rows: dict[int, list[float]]) -> None:
        self.rows, self.queue = rows, deque()

    failed = False

    def end_step(self, step: int, loss: object, samples: object) -> bool:
        self.queue.append((step, np.array([*self.rows[step], math.nan]), True))  # (no samples counted)
        return True

    def take(self, *, wait: bool) -> list:
        return [self.queue.popleft() for _ in range(len(self.queue) - (0 if wait else 2))] if self.queue else []

    def refresh(self) -> None:
        pass


def test_the_steps_after_a_spike_read_late_are_counted_from_the_spike() -> None:
    """A spike at step 40 whose row is read at step 42: the steps logged in full are those up to
    40 + after that are still to come (43), not three more from the step that read it."""
    from tblog_hooks.diagnostics.spikes import SpikeWatch
    from tblog_hooks.spike_log import SpikeLog

    noise = np.random.default_rng(0).lognormal(0.0, 0.05, 60)
    rows = {s: [float(noise[s] * (100.0 if s == 40 else 1.0)) ** 2, 0.0, 1.0] for s in range(60)}  # (a, others, loss)
    log = SpikeLog(_LateRows(rows), SpikeWatch(Spikes(), ["a"]), None, None, every=1000, force=True)  # type: ignore[arg-type]
    full = [s + 1 for s in range(60) if log.step(s, None)]
    assert full == [43]


@needs_cuda
def test_cuda_norms_reach_the_host_without_a_sync(tmp_path) -> None:
    device = torch.device("cuda")
    model = mlp(16, 32, 32, 4, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    teacher = torch.randn(16, 4, device=device)
    truths, losses = [], []
    with HookLogger(model, log_dir=tmp_path, every=1000, optimizer=opt, spikes=True) as hooks:
        for step in range(40):
            if step == 2:  # step 0 is logged; step 1 makes the ring and the index tensors
                torch.cuda.set_sync_debug_mode("error")
            x = torch.randn(32, 16, device=device)
            loss = nn.functional.cross_entropy(model(x), (x @ teacher).argmax(1))
            loss.backward()
            truths.append(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])))
            losses.append(loss.detach())
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
        torch.cuda.set_sync_debug_mode("default")
    run = read_run(tmp_path)
    assert run.scalars["step/grad_norm"] == pytest.approx(dict(enumerate(torch.stack(truths).tolist())), rel=1e-4)
    assert run.scalars["step/loss"] == pytest.approx(dict(enumerate(torch.stack(losses).tolist())), rel=1e-6)


@needs_cuda
def test_cuda_ring_is_pinned_when_the_first_step_has_no_optimizer_step(tmp_path) -> None:
    """A first step without an optimizer step (a number for its loss) has no CUDA tensor: the
    ring is pinned once one comes, so that the copies stay non-blocking."""
    device = torch.device("cuda")
    model = mlp(16, 32, 4, seed=0).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HookLogger(model, log_dir=tmp_path, every=1000, optimizer=opt, spikes=True) as hooks:
        hooks.step(loss=1.0)
        for _ in range(3):
            loss = model(torch.randn(8, 16, device=device)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
        assert hooks._spikes.norms._ring._host.is_pinned()  # type: ignore[union-attr]
    assert sorted(read_run(tmp_path).scalars["step/grad_norm"]) == [1, 2, 3]


@pytest.mark.cuda  # (in the GPU check, which skips it on one GPU)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_model_over_two_gpus_and_its_loss_on_the_second(tmp_path) -> None:
    """The norms of parameters on two GPUs are added up on the first; the loss, on the second, is
    read once its own copy is done."""
    first, second = mlp(16, 32, seed=0).to("cuda:0"), mlp(32, 4, seed=1).to("cuda:1")
    model = nn.Sequential(first, second)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    truths, losses = [], []
    with HookLogger(model, log_dir=tmp_path, every=1000, optimizer=opt, spikes=True) as hooks:
        for _ in range(20):
            loss = second(first(torch.randn(8, 16, device="cuda:0")).to("cuda:1")).square().mean()
            loss.backward()
            truths.append(math.sqrt(sum(p.grad.double().square().sum().item() for p in model.parameters())))
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
    run = read_run(tmp_path)
    assert run.scalars["step/grad_norm"] == pytest.approx(dict(enumerate(truths)), rel=1e-4)
    assert run.scalars["step/loss"] == pytest.approx(dict(enumerate(losses)), rel=1e-6)
