"""The ``tblog-hooks demo`` command trains and writes a run TensorBoard can read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import read_run

from tblog_hooks.cli import main
from tblog_hooks.diagnostics.findings import FINDING_KINDS as KINDS

ROOT = Path(__file__).resolve().parent.parent


def test_demo_writes_a_readable_run_without_findings(tmp_path, capsys) -> None:
    # The healthy demo: stock ResNet-18, default init, FakeData. Diagnostics must stay quiet.
    assert main(["demo", "--logdir", str(tmp_path), "--steps", "6", "--every", "2", "--device", "cpu"]) == 0
    assert f"tensorboard --logdir {tmp_path}" in capsys.readouterr().out
    run = read_run(tmp_path / "resnet18")
    assert set(run.scalars["param_grad/global_norm"]) == {0, 2, 4}
    assert "activation/layer4.1.conv2" in run.histograms
    assert all(v == 0 for kind in KINDS for v in run.scalars[f"health/{kind}"].values())
    assert main(["report", str(tmp_path), "--fail-on", ",".join(KINDS)]) == 0
    assert "findings: none" in capsys.readouterr().out


def test_the_commands_the_demo_prints_run_as_printed_without_an_active_environment(tmp_path) -> None:
    """``bash scripts/demo`` runs ``.venv/bin/tblog-hooks`` from a shell where ``.venv`` is not
    active: the printed commands name the environment's scripts by a path the shell runs."""
    venv_bin = Path(sys.executable).parent
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}  # (no virtual environment on it)
    printed = subprocess.run(
        [str(venv_bin / "tblog-hooks"), "demo", "--logdir", str(tmp_path / "runs"), "--steps", "1", "--device", "cpu"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=True,
    ).stdout  # fmt: skip
    commands = [line.split(":", 1)[1].split() for line in printed.splitlines() if line.startswith(("open it", "or:"))]
    scripts = [venv_bin / "tensorboard", venv_bin / "tblog-hooks"]
    assert [c[0] for c in commands] == [str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in scripts]
    for command in commands:  # each starts as printed, from the same shell
        out = subprocess.run([*command[:1], "--help"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (command, out.stderr)


@pytest.mark.parametrize("argv", [["--every", "0"], ["--steps", "-3"], ["--every", "ten"]])
def test_demo_rejects_bad_counts_as_a_usage_error(tmp_path, capsys, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--logdir", str(tmp_path), *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"argument {argv[0]}: must be a positive integer, got {argv[1]!r}" in err
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written
