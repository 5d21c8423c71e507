"""Every tag, figure and finding of a fixed set of seeded runs equals the reference recorded on
the code before the recipe refactor (``scripts/golden.py``), exactly up to float rounding."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import golden  # noqa: E402


def test_the_reference_runs_are_unchanged() -> None:
    expected = json.loads((ROOT / "tests" / "golden.json").read_text())
    got = json.loads(json.dumps(golden.record_all()))
    assert golden.differences(expected, got) == []
