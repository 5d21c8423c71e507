"""``scripts/train.py`` under torchrun: two CPU processes, AMP, accumulation, one writer."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from conftest import read_run

ROOT = Path(__file__).resolve().parent.parent


def test_train_script_under_torchrun_with_two_processes(tmp_path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        str(ROOT / "scripts" / "train.py"), "--logdir", str(tmp_path), "--steps", "4", "--every", "2",
        "--accumulate", "3", "--batch-size", "8", "--device", "cpu", "--reduce-ranks",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # rank 0 only
    run = read_run(tmp_path)
    assert set(run.scalars["amp/skipped_step"]) == {0, 2}
    assert run.scalars["amp/loss_scale"][0] == 2.0**16
    # Three micro-batches of 8 examples per optimizer step, on each of the two ranks.
    assert run.histograms["activation/0"][0].num == 3 * 8 * 128
    dead = run.scalar("activation/dead_frac/0", 0)
    assert 0 <= dead <= 1
    assert math.isfinite(run.scalar("param_grad/global_norm", 2)) and run.scalar("param_grad/global_norm", 2) > 0
    assert "train: 100%" in done.stderr  # tqdm progress, from rank 0
