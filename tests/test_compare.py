"""``tblog-hooks compare``: two runs written by the logger, compared from their event files."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import spawn_ranks
from models import mlp
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from tblog_hooks import HookLogger
from tblog_hooks.cli import main
from tblog_hooks.cli.report import load
from tblog_hooks.diagnostics.compare import Tolerance

STEPS, EVERY = 12, 2
#: The run changes from this step on (a logged step: ``EVERY`` divides it).
CHANGED = 6


def _batch(step: int, rank: int = 0, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def train_mlp(
    log_dir: Path,
    *,
    every: int = EVERY,
    before_step: Callable[[nn.Sequential, int], None] = lambda model, step: None,
    batch: Callable[[int], torch.Tensor] = _batch,
    **options: Any,
) -> None:
    """``STEPS`` SGD steps of a 3-layer tanh MLP (modules ``0`` to ``4``) on fixed batches,
    ``spikes=True`` unless ``options`` say otherwise; ``before_step(model, step)`` runs before each step's forward."""
    model = mlp(6, 12, 12, 3, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    options = {"spikes": True, **options}
    with HookLogger(model, log_dir=log_dir, every=every, optimizer=opt, **options) as hooks:
        for step in range(STEPS):
            before_step(model, step)
            loss = model(batch(step)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(**({"loss": loss} if options["spikes"] else {}))


def _compare(capsys: pytest.CaptureFixture[str], *argv: object) -> tuple[int, dict[str, Any]]:
    """The exit status and the ``--json`` document of ``compare argv``."""
    status = main(["compare", *map(str, argv), "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_the_same_seed_twice_agrees(tmp_path, capsys) -> None:
    train_mlp(tmp_path / "a")
    train_mlp(tmp_path / "b")
    status, doc = _compare(capsys, tmp_path / "a", tmp_path / "b")
    assert status == 0
    assert doc == {
        "a": str(tmp_path / "a"),
        "b": str(tmp_path / "b"),
        "common_steps": STEPS // EVERY,
        "compared": doc["compared"],
        "diverged": False,
        "first": None,
        "modules": [],
        "per_step": {"loss": None, "grad_norm": None},
    }
    # Every module and parameter statistic of every logged step, and both series at every step.
    scalars = _named_scalars(tmp_path / "a")
    assert doc["compared"] == scalars + 2 * STEPS
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert f"{STEPS // EVERY} logged steps in common, {doc['compared']:,} values compared" in out
    assert f"step/loss agrees at the {STEPS} steps both runs hold" in out
    assert out.rstrip().endswith("every common value agrees")


def _named_scalars(run_dir: Path) -> int:
    run = load(run_dir, "x")
    roots = ("activation/", "input/", "attention/", "gradient/", "param_grad/", "param/")
    return sum(1 for s in run.scalars.values() for t in s if t.startswith(roots) and t.count("/") == 2)


def test_a_weight_changed_between_logged_steps_parts_there_forward(tmp_path, capsys) -> None:
    def change(model: nn.Sequential, step: int) -> None:
        if step == CHANGED - 1:  # after step 4's update, before step 5 (not logged)
            with torch.no_grad():
                model[2].weight.mul_(1.01)

    train_mlp(tmp_path / "a")
    train_mlp(tmp_path / "b", before_step=change)
    status, doc = _compare(capsys, tmp_path / "a", tmp_path / "b")
    assert status == 1 and doc["diverged"]
    first = doc["first"]
    assert (first["step"], first["module"]) == (CHANGED, "2")
    assert first["stat"] == "activation/std/2"  # of those that differ, a scale statistic tells it
    assert first["rel"] == pytest.approx(abs(first["a"] - first["b"]) / max(abs(first["a"]), abs(first["b"])))
    assert first["rel"] > 1e-3
    by_module = {m["module"]: m for m in doc["modules"]}
    # The module before it differs at that step too, in backward only: it is not where they part.
    assert by_module["0"]["step"] == CHANGED and by_module["0"]["stat"].startswith(("gradient/", "param"))
    assert by_module["2"] == {k: first[k] for k in ("module", "step", "stat", "a", "b", "rel")}
    assert [m["step"] for m in doc["modules"]] == sorted(m["step"] for m in doc["modules"])
    assert doc["per_step"]["loss"]["step"] == CHANGED - 1  # the loss of every step: from step 5 on
    main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert f"they part at step {CHANGED} in 2 (forward): {first['stat']}" in capsys.readouterr().out


def test_an_output_gradient_scaled_from_a_step_on_parts_there_backward(tmp_path, capsys) -> None:
    def scale(model: nn.Sequential, step: int) -> None:
        if step == CHANGED:
            model[2].register_full_backward_pre_hook(lambda module, grad_output: (grad_output[0] * 1.5,))

    train_mlp(tmp_path / "a")
    train_mlp(tmp_path / "b", before_step=scale)
    status, doc = _compare(capsys, tmp_path / "a", tmp_path / "b")
    assert status == 1
    first = doc["first"]
    assert (first["step"], first["module"]) == (CHANGED, "2")
    assert first["stat"].startswith(("gradient/", "param_grad/", "param/"))
    assert doc["per_step"]["loss"]["step"] == CHANGED + 1  # the update of step 6 changes step 7's loss
    assert doc["per_step"]["grad_norm"]["step"] == CHANGED
    main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    assert f"they part at step {CHANGED} in 2 (backward)" in capsys.readouterr().out


def test_steps_only_one_run_logged_are_skipped_and_counted(tmp_path, capsys) -> None:
    train_mlp(tmp_path / "a", every=2)
    train_mlp(tmp_path / "b", every=4)
    status, doc = _compare(capsys, tmp_path / "a", tmp_path / "b")
    assert status == 0 and doc["common_steps"] == len(range(0, STEPS, 4))
    main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    skipped = len(range(0, STEPS, 2)) - len(range(0, STEPS, 4))
    assert f"skipped: {skipped} logged steps only {tmp_path / 'a'} holds, 0 only {tmp_path / 'b'} holds" in (
        capsys.readouterr().out
    )


def test_only_the_modules_both_runs_watch_are_compared(tmp_path, capsys) -> None:
    # (Without spikes=: step/grad_norm is the norm of the watched parameters' gradients.)
    train_mlp(tmp_path / "all", spikes=False)
    train_mlp(tmp_path / "some", modules=["2"], spikes=False)
    _, both = _compare(capsys, tmp_path / "all", tmp_path / "all")
    status, doc = _compare(capsys, tmp_path / "all", tmp_path / "some")
    assert status == 0 and 0 < doc["compared"] < both["compared"]
    assert doc["compared"] == _named_scalars(tmp_path / "some")


def test_a_nan_in_one_run_parts_there_nan_in_both_agrees(tmp_path, capsys) -> None:
    def poisoned(step: int) -> torch.Tensor:
        x = _batch(step)
        if step == CHANGED:
            x[0, 0] = math.nan
        return x

    train_mlp(tmp_path / "a")
    train_mlp(tmp_path / "nan", batch=poisoned)
    train_mlp(tmp_path / "nan again", batch=poisoned)
    status, doc = _compare(capsys, tmp_path / "a", tmp_path / "nan")
    assert status == 1
    first = doc["first"]
    assert (first["step"], first["module"]) == (CHANGED, "0") and first["stat"].startswith("activation/")
    assert (first["b"], first["rel"]) == (None, None) and math.isfinite(first["a"])  # NaN as report --json writes it
    assert _compare(capsys, tmp_path / "nan", tmp_path / "nan again")[0] == 0


def two_loggers(run_dir: Path) -> None:
    """Two MLPs of different initial weights, logged with ``prefix="P"`` and ``prefix="Q"`` into one directory."""
    models = {"P": mlp(6, 12, 3, seed=0), "Q": mlp(6, 12, 3, seed=1)}
    opt = torch.optim.SGD([p for m in models.values() for p in m.parameters()], lr=0.1)
    hooks = [HookLogger(m, log_dir=run_dir, every=2, prefix=p, optimizer=opt) for p, m in models.items()]
    for step in range(4):
        sum(m(_batch(step)).square().mean() for m in models.values()).backward()  # type: ignore[union-attr]
        opt.step()
        opt.zero_grad()
        for h in hooks:
            h.step()
    for h in hooks:
        h.close()


def test_prefixes_choose_the_loggers(tmp_path, capsys) -> None:
    two_loggers(tmp_path / "pair")
    pair = str(tmp_path / "pair")
    assert main(["compare", pair, pair]) == 2
    assert f"{pair!r} holds the loggers of the prefixes 'P', 'Q': choose one with --prefix" in capsys.readouterr().err
    assert _compare(capsys, pair, pair, "--prefix", "Q")[0] == 0  # --other-prefix defaults to --prefix
    status, doc = _compare(capsys, pair, pair, "--prefix", "P", "--other-prefix", "Q")
    assert status == 1 and (doc["a"], doc["b"]) == (f"{pair} [P]", f"{pair} [Q]")
    assert (doc["first"]["step"], doc["first"]["module"]) == (0, "0")  # other initial weights: the first layer
    assert main(["compare", pair, pair, "--prefix", "R"]) == 2
    assert f"{pair!r} holds no logger with the prefix 'R'; it holds 'P', 'Q'" in capsys.readouterr().err


def test_bad_input_exits_2_with_a_message(tmp_path, capsys) -> None:
    train_mlp(tmp_path / "run")
    run = str(tmp_path / "run")
    with SummaryWriter(tmp_path / "user") as writer:
        writer.add_scalar("loss", 1.0, 0)
    with SummaryWriter(tmp_path / "odd") as writer:  # this package's tags at odd steps only
        for step in (1, 3):
            writer.add_scalar("activation/mean/0", 0.5, step)
    (tmp_path / "folder").mkdir()
    cases = {
        (str(tmp_path / "missing"), run): f"{str(tmp_path / 'missing')!r} does not exist",
        (run, str(tmp_path / "user")): f"{str(tmp_path / 'user')!r} holds no tblog_hooks statistics",
        (run, str(tmp_path / "folder")): "no TensorBoard event files",
        (run, str(tmp_path / "odd")): f"{run!r} and {str(tmp_path / 'odd')!r} have no logged step in common: "
        f"{run!r} logged 6 steps (0..10), {str(tmp_path / 'odd')!r} 2 steps (1..3)",
    }
    for (a, b), message in cases.items():
        assert main(["compare", a, b]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("tblog-hooks compare: ") and message in captured.err
    for argv, message in [(["--rtol", "-1"], "rtol must be a finite number >= 0, got -1.0"), (["--atol", "x"], "")]:
        with pytest.raises(SystemExit) as info:
            main(["compare", run, run, *argv])
        assert info.value.code == 2 and message in capsys.readouterr().err


#: The statistics two ranks promise equal to one process's: output gradients are each rank's loss's
#: (of its own batch's mean), not of the mean over both ranks, so they are left out.
_RANKS = {"gradients": False}


def _ranks_worker(rank: int, root: str) -> None:
    model = nn.parallel.DistributedDataParallel(mlp(6, 12, 3, seed=0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=f"{root}/ranks", every=1, optimizer=opt, reduce_ranks=True, **_RANKS) as hooks:
        for step in range(3):
            model(_batch(step, rank)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_ranks_with_reduce_ranks_agree_with_one_process(tmp_path, capsys) -> None:
    spawn_ranks(_ranks_worker, tmp_path, 2)
    model = mlp(6, 12, 3, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=tmp_path / "one", every=1, optimizer=opt, **_RANKS) as hooks:
        for step in range(3):
            model(torch.cat([_batch(step, rank) for rank in range(2)])).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    status, doc = _compare(capsys, tmp_path / "one", tmp_path / "ranks")
    assert doc["modules"] == [] and status == 0 and doc["common_steps"] == 3


def test_the_rule_of_two_values() -> None:
    inf, nan = math.inf, math.nan
    pairs = [(1.0, 1.0009), (1.0, 1.0011), (0.0, 1e-9), (nan, nan), (inf, inf), (inf, -inf), (nan, 1.0), (inf, 1.0)]
    a, b = (np.array(side) for side in zip(*pairs, strict=True))
    assert Tolerance().differ(a, b).tolist() == [False, True, True, False, False, True, True, True]
    assert Tolerance(rtol=0.0, atol=1e-8).differ(a, b).tolist()[:3] == [True, True, False]
