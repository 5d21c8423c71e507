"""Every tag, figure and finding of a fixed set of seeded runs equals the reference recorded on
the code before the recipe refactor (``scripts/golden.py``), exactly up to float rounding; and
the same runs on the kernel path (the fused Triton kernels) record what the torch path does
(``both_paths``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from both_paths import differences, golden, on_its_own_stack

from tblog_hooks.kernels import VARIABLE

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def on_torch() -> dict[str, dict]:
    """Every run recorded on the torch path (``TBLOG_HOOKS_KERNELS=torch``)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(VARIABLE, "torch")
        return json.loads(json.dumps(on_its_own_stack(golden.record_all)))


def test_the_reference_runs_are_unchanged() -> None:
    """Compared in a process whose numbers are the same on every x86-64 machine (``golden.REPRODUCIBLE``)."""
    script, reference = ROOT / "scripts" / "golden.py", ROOT / "tests" / "golden.json"
    env = {**os.environ, VARIABLE: "torch"}
    compared = subprocess.run([sys.executable, script, "compare", reference], env=env, capture_output=True, text=True)
    assert compared.returncode == 0, compared.stdout + compared.stderr


@pytest.mark.filterwarnings("ignore::RuntimeWarning:numpy")  # (the interpreter's NaN/Inf arithmetic)
@pytest.mark.filterwarnings("ignore::RuntimeWarning:triton")
def test_the_kernel_path_records_the_same_runs(
    on_torch: dict[str, dict], monkeypatch: pytest.MonkeyPatch, launches: Counter[str]
) -> None:
    """Every run recorded through the kernels in Triton's interpreter (CPU tensors with
    ``TBLOG_HOOKS_KERNELS=triton``): every scalar, histogram, finding, tensor and image as on the
    torch path, to the rounding ``both_paths`` allows."""
    fused = pytest.importorskip("tblog_hooks.kernels.fused", reason="Triton is not importable")
    if not fused.INTERPRETED:
        pytest.skip("CPU runs through the kernels: TRITON_INTERPRET=1")
    monkeypatch.setenv(VARIABLE, "triton")
    on_kernels = json.loads(json.dumps(on_its_own_stack(golden.record_all)))
    assert launches["_partials"] > 0 and launches["_scaled_counts"] > 0 and launches["_buckets"] > 0
    assert on_kernels.keys() == on_torch.keys()
    assert [f"/{run}{d}" for run in on_torch for d in differences(on_torch[run], on_kernels[run])] == []
