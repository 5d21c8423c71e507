"""Where a logged step begins and ends, in loops as the standard PyTorch examples write them: a
closure optimizer's evaluations (LBFGS), a forgotten ``hooks.step()``, a gradient left from an
earlier phase of training, forward passes after the last step."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import read_run
from models import mlp
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger


def _norm(t: torch.Tensor) -> float:
    return float(t.detach().double().norm())


@pytest.mark.parametrize("with_optimizer", [False, True])
def test_closure_optimizer_step_logs_its_last_evaluation(tmp_path, with_optimizer: bool) -> None:
    """LBFGS evaluates the closure several times a step; the step's statistics are the last evaluation's."""
    model = mlp(6, 16, 3)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=6)
    x, y = torch.randn(32, 6), torch.randn(32, 3)
    outputs: list[torch.Tensor] = []  # module 0's output and output gradient, per evaluation: plain hooks
    grads: list[torch.Tensor] = []

    def keep(module: nn.Module, args: object, out: torch.Tensor) -> None:
        outputs.append(out.detach().double().clone())
        out.register_hook(lambda g: grads.append(g.detach().double().clone()))

    model[0].register_forward_hook(keep)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        return loss

    expected: dict[int, tuple[torch.Tensor, torch.Tensor, float]] = {}
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt if with_optimizer else None) as hooks:
        for step in range(2):
            outputs.clear()
            grads.clear()
            opt.step(closure)
            assert len(outputs) == len(grads) > 2  # the scenario: several evaluations in one step
            expected[step] = (outputs[-1], grads[-1], _norm(model[0].weight.grad))
            hooks.step()
    run = read_run(tmp_path)
    for step, (out, grad, weight_grad) in expected.items():
        assert run.scalar("activation/mean/0", step) == pytest.approx(float(out.mean()), rel=1e-5)
        assert run.scalar("activation/max/0", step) == pytest.approx(float(out.max()), rel=1e-5)
        assert run.scalar("gradient/norm/0", step) == pytest.approx(float(grad.norm()), rel=1e-5)
        assert run.scalar("param_grad/norm/0.weight", step) == pytest.approx(weight_grad, rel=1e-5)
    assert run.histograms["activation/0"][0].num == expected[0][0].numel()  # (the first logged step has them)


@pytest.mark.parametrize("every", [1, 4], ids=["logged", "not-logged"])
def test_closure_optimizer_steps_count_one_evaluation_s_samples(tmp_path, every: int) -> None:
    """``spikes=``' ``step/samples`` of an LBFGS step is its batch, not the batch times the number
    of evaluations, on every step (``spikes=`` judges each one, logged or not)."""
    model = mlp(6, 16, 3, seed=0)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
    x, y = torch.randn(32, 6, generator=torch.Generator().manual_seed(1)), torch.zeros(32, 3)
    evaluations: list[int] = []

    def closure() -> torch.Tensor:
        evaluations.append(1)
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        return loss

    with HookLogger(model, log_dir=tmp_path, every=every, optimizer=opt, spikes=True) as hooks:
        for _ in range(3):
            loss = opt.step(closure)
            hooks.step(loss=loss)
    assert len(evaluations) > 3  # the scenario: several evaluations a step
    assert read_run(tmp_path).scalars["step/samples"] == {0: 32, 1: 32, 2: 32}


def _lbfgs_run(log_dir, *, compiled: bool) -> tuple[dict[str, dict[int, float]], dict[int, float]]:
    """The scalars an LBFGS run logs, and (eager) module 0's mean output in each step's last evaluation."""
    model = mlp(6, 16, 3, seed=0)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    x, y = torch.randn(32, 6, generator=torch.Generator().manual_seed(1)), torch.zeros(32, 3)
    means: list[float] = []
    if not compiled:
        model[0].register_forward_hook(lambda m, a, out: means.append(float(out.detach().double().mean())))
    last: dict[int, float] = {}
    with HookLogger(model, log_dir=log_dir, every=1) as hooks:
        run = torch.compile(model, backend="aot_eager") if compiled else model

        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = (run(x) - y).square().mean()
            loss.backward()
            return loss

        for step in range(2):
            opt.step(closure)
            if means:
                last[step] = means[-1]
            hooks.step()
    return read_run(log_dir).scalars, last


def test_compiled_closure_step_logs_its_last_evaluation_as_eager_does(tmp_path) -> None:
    """Under ``torch.compile`` the forward's records are the compiled hooks' (``step._Sink``), its
    gradients' the probes': the earlier evaluations' are dropped from both."""
    eager, last = _lbfgs_run(tmp_path / "eager", compiled=False)
    torch._dynamo.reset()
    compiled, _ = _lbfgs_run(tmp_path / "compiled", compiled=True)
    assert eager["activation/mean/0"] == pytest.approx(last, rel=1e-5)
    assert set(compiled) == set(eager)
    for tag in ("activation/mean/0", "activation/max/2", "gradient/norm/0", "gradient/norm/2"):
        assert compiled[tag] == pytest.approx(eager[tag], rel=1e-4), tag


def test_closure_step_keeps_what_came_before_it(tmp_path) -> None:
    """Micro-batches before ``optimizer.step(closure)`` (Lightning accumulates so, calling the closure
    itself for all but the last) pool with the closure's one evaluation."""
    model = mlp(6, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randn(8, 6) for _ in range(3)]
    outputs: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda m, a, out: outputs.append(out.detach().double().clone()))

    def closure(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss

    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        for x in batches[:-1]:
            closure(x)
        opt.step(lambda: closure(batches[-1]))
        hooks.step()
    pooled = torch.cat(outputs)
    assert len(outputs) == 3
    assert read_run(tmp_path).scalar("activation/mean/0", 0) == pytest.approx(float(pooled.mean()), rel=1e-5)


def _train(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def test_optimizer_stepping_twice_in_one_logged_step_warns_once_naming_step(tmp_path) -> None:
    """A loop that never calls ``hooks.step()``: every optimizer step would pool into step 0, silently."""
    model = mlp(6, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    with warnings.catch_warnings(record=True) as caught, HookLogger(model, log_dir=tmp_path, every=1):
        warnings.simplefilter("always")
        for _ in range(5):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    said = [w for w in caught if "stepped a second time" in str(w.message)]
    assert len(said) == 1
    assert "SGD" in str(said[0].message) and "call hooks.step() once after each optimizer step" in str(said[0].message)
    assert said[0].filename == __file__  # the user's opt.step() line


@pytest.mark.parametrize("loop", ["accumulation", "gan", "critic"])
def test_one_step_per_optimizer_per_logged_step_is_silent(tmp_path, loop: str) -> None:
    """Gradient accumulation (four backwards, one optimizer step); DCGAN's two optimizers, each
    stepping once, two loggers sharing a writer; a WGAN critic stepping three times per generator
    step, whose optimizer steps no parameter the generator's logger watches."""
    generator, critic = mlp(4, 8, 4, seed=0), mlp(4, 8, 1, seed=1)
    opt_g = torch.optim.Adam(generator.parameters(), lr=1e-3)
    opt_d = torch.optim.Adam(critic.parameters(), lr=1e-3)
    writer = SummaryWriter(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loggers = [HookLogger(generator, writer=writer, prefix="G", every=1)]
        if loop == "gan":
            loggers.append(HookLogger(critic, writer=writer, prefix="D", every=1))
        for _ in range(3):
            if loop == "accumulation":
                opt_g.zero_grad()
                for _ in range(4):
                    generator(torch.randn(8, 4)).square().mean().backward()
                opt_g.step()
            else:
                for _ in range(3 if loop == "critic" else 1):
                    opt_d.zero_grad()
                    fake = generator(torch.randn(8, 4)).detach()
                    (critic(fake).mean() - critic(torch.randn(8, 4)).mean()).backward()
                    opt_d.step()
                opt_g.zero_grad()
                (-critic(generator(torch.randn(8, 4))).mean()).backward()
                opt_g.step()
            for hooks in loggers:
                hooks.step()
        for hooks in loggers:
            hooks.close()
    writer.close()
    assert not [w for w in caught if "hooks.step()" in str(w.message)]
    assert set(read_run(tmp_path).scalars["G/activation/mean/0"]) == {0, 1, 2}


def test_gradient_left_from_an_earlier_phase_is_not_taken_for_one_no_optimizer_stepped(tmp_path) -> None:
    """Fine-tuning one head after training both: the other head keeps the gradient of phase one
    (its optimizer is gone, nothing zeroes it) though no backward reaches it any more."""
    model = nn.ModuleDict({"trunk": nn.Linear(6, 8), "a": nn.Linear(8, 2), "b": nn.Linear(8, 2)})

    def loss(heads: tuple[str, ...]) -> torch.Tensor:
        h = torch.tanh(model["trunk"](torch.randn(8, 6)))
        return sum(model[head](h).square().mean() for head in heads)  # type: ignore[return-value]

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        warnings.catch_warnings(record=True) as caught,
        HookLogger(model, log_dir=tmp_path, every=1, optimizer=opt) as hooks,
    ):
        warnings.simplefilter("always")
        for step in range(4):
            if step == 2:  # phase two: head b only
                opt = torch.optim.SGD([*model["trunk"].parameters(), *model["b"].parameters()], lr=0.1)
            opt.zero_grad()
            loss(("a", "b") if step < 2 else ("b",)).backward()
            opt.step()
            hooks.step()
    assert model["a"].weight.grad is not None  # the scenario: a stale gradient, there at every step of phase two
    assert not [w for w in caught if "no torch.optim optimizer stepped them" in str(w.message)]
    assert set(read_run(tmp_path).scalars["param_grad/norm/a.weight"]) == {0, 1}


@pytest.mark.parametrize(
    ("after", "steps"),
    [("prediction", {0, 1, 2}), ("backward", {0, 1, 2, 3}), ("nothing", {0, 1, 2})],
)
def test_close_writes_the_pending_step_only_if_it_trained(tmp_path, after: str, steps: set[int]) -> None:
    """Forward passes after the last ``step()`` (a ``predict()`` in training mode) are no step; a
    backward after it is (the last micro-batches of a run stopped early)."""
    model = mlp(6, 16, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    with HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        for _ in range(3):
            _train(model, opt, x)
            hooks.step()
        if after == "prediction":
            model(x)
        elif after == "backward":
            model(x).square().mean().backward()
    assert set(read_run(tmp_path).scalars["activation/mean/0"]) == steps


def test_forward_passes_of_a_run_that_never_called_step_are_written(tmp_path) -> None:
    """A run of forward passes only, closed without a ``step()``: its one step is all it recorded."""
    model = mlp(6, 16, 3)
    x = torch.randn(8, 6)
    with HookLogger(model, log_dir=tmp_path, every=1):
        out = model[0](x).detach().double()
        model(x)
    assert read_run(tmp_path).scalar("activation/mean/0", 0) == pytest.approx(float(out.mean()), rel=1e-5)
