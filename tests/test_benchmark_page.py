"""The benchmark page's figures are what its own commands print (those that do not depend on the machine)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]


def _large_models(monkeypatch: pytest.MonkeyPatch) -> object:
    """``scripts/large_models.py`` as a module (registered while the test runs: its dataclass needs it)."""
    spec = importlib.util.spec_from_file_location("large_models", ROOT / "scripts" / "large_models.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    monkeypatch.setitem(sys.modules, "large_models", module)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _documented_row(layers: int) -> list[str]:
    """The cells of the large-models table's row for ``layers`` on the benchmark page."""
    page = (ROOT / "docs" / "benchmark.md").read_text()
    table = page[page.index("<!-- bench: large models table -->") :]
    (row,) = re.findall(rf"^\| {layers} \|.*\|$", table, flags=re.MULTILINE)[:1]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_the_large_models_table_is_what_scripts_large_models_prints(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    script = _large_models(monkeypatch)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the script runs
    logging.getLogger("tblog_hooks.health").setLevel(logging.ERROR)
    try:
        args = argparse.Namespace(histograms=None, blocks_every=None, numerics=False, steps=10, repeat=1, report=False)
        row = script.measure(6, args, tmp_path)  # type: ignore[attr-defined]
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("tblog_hooks.health").setLevel(logging.NOTSET)
    printed = row.cells()
    documented = _documented_row(6)
    assert printed[:2] == documented[:2] and printed[4] == documented[4]  # modules, tags: exact
    per_module = float(documented[3].removesuffix(" B").replace(",", ""))
    assert row.bytes / (row.modules * row.steps) == pytest.approx(per_module, rel=0.02)


def test_the_benchmark_runs(tmp_path) -> None:
    """``scripts/bench.py`` end to end on the short workload: a bench that no longer runs cannot
    reproduce the page's figures."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), "--workload", "w2", "--steps", "10", "--block", "5",
         "--warmup", "1", "--configs", "none,tblog,idle,manual", "--json", str(tmp_path / "bench.json")],
        capture_output=True, text=True, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    assert "| w2 | tblog |" in out and "aten ops per watched module" in out
    results = json.loads((tmp_path / "bench.json").read_text())
    assert set(results["results"]["w2"]) == {"none", "tblog", "idle", "manual"}
