"""scripts/cuda_check.py runs every CUDA test of the suite, and skips cleanly without a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def test_every_cuda_condition_is_conftest_needs_cuda() -> None:
    """A test skipped without CUDA by any other condition would not be marked ``cuda``, and the
    check (``pytest -m cuda``) would never run it."""
    spelled = {
        path.name: len(re.findall(r"not torch\.cuda\.is_available\(\)", path.read_text()))
        for path in TESTS.glob("*.py")
        if path.name != "conftest.py"
    }
    assert {name: n for name, n in spelled.items() if n} == {}


def test_the_check_selects_the_cuda_tests_of_every_file_that_has_them() -> None:
    files = ["test_cuda.py", "test_no_sync.py", "test_compile.py", "test_param_sources.py"]
    files += ["test_training_loops.py", "test_spikes.py", "test_kernels.py"]
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "cuda", *(f"tests/{f}" for f in files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    selected = [line for line in out.stdout.splitlines() if "::" in line]
    assert {line.split("::")[0].removeprefix("tests/") for line in selected} == set(files), out.stdout
    assert "tests/test_compile.py::test_compiled_model_logs_what_eager_logs[inductor-cuda]" in selected
    assert not any("-cpu]" in line or "[cpu-" in line for line in selected)  # the CPU variants stay out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here: the check would run in full")
def test_the_check_skips_cleanly_without_a_gpu() -> None:
    out = subprocess.run(
        [sys.executable, "scripts/cuda_check.py"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0 and "no CUDA device: the CUDA check is skipped" in out.stdout
