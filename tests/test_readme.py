"""The README's quickstart runs as written and writes what it promises."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import read_run

README = Path(__file__).resolve().parent.parent / "README.md"


def _run_block(heading: str) -> None:
    """Run the first Python block after ``heading`` as a script."""
    block = re.search(rf"{re.escape(heading)}\n.*?```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    exec(compile(block.group(1), str(README), "exec"), {"__name__": "readme"})


def test_quickstart_runs(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    _run_block("## Quickstart")
    assert "('0', '2', '4')" in capsys.readouterr().out
    run = read_run(tmp_path / "runs" / "quickstart")
    assert sorted(run.scalars["param_grad/global_norm"]) == list(range(0, 100, 10))


def test_lightning_section_runs(tmp_path, monkeypatch) -> None:
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    _run_block("### Lightning")
    run = read_run(tmp_path / "runs" / "lightning" / "lightning_logs" / "version_0")
    assert sorted(run.scalars["param_grad/global_norm"]) == [0, 4, 8, 12]
    assert sorted(run.scalars["loss"]) == [3, 7, 11, 15]
    assert "activation/mean/net.1" in run.scalars  # modules=["net.*"] watches the ReLU too


def test_transformers_section_runs(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    _run_block("### Hugging Face Trainer")
    (run_dir,) = (tmp_path / "runs" / "hf" / "runs").iterdir()
    run = read_run(run_dir)
    assert sorted(run.scalars["param_grad/global_norm"]) == sorted(run.scalars["train/loss"]) == [4, 8, 12, 16]
