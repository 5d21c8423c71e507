"""The README's quickstart runs as written and writes what it promises."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import read_run

README = Path(__file__).resolve().parent.parent / "README.md"


def test_quickstart_runs(tmp_path, monkeypatch, capsys) -> None:
    block = re.search(r"## Quickstart\n.*?```python\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    monkeypatch.chdir(tmp_path)
    exec(compile(block.group(1), str(README), "exec"), {"__name__": "readme"})
    assert "('0', '2', '4')" in capsys.readouterr().out
    run = read_run(tmp_path / "runs" / "quickstart")
    assert sorted(run.scalars["param_grad/global_norm"]) == list(range(0, 100, 10))
