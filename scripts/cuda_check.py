"""The CUDA check, one command (under 10 minutes on one GPU): every CUDA test of the suite (the
tests marked ``cuda``: each one ``conftest.needs_cuda`` skips without a device), then the overhead
benchmark on CUDA with larger batches, printed as a Markdown table. Without a CUDA device it
says so and exits 0: there is nothing to check.

    pip install --no-deps -e . && python scripts/cuda_check.py [--json cuda_bench.json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> int:
    print("+", " ".join(args), flush=True)
    return subprocess.call([sys.executable, *args], cwd=ROOT)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write each benchmark's results to <stem>-<workload>.json")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: the CUDA check is skipped")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    failed = run("-m", "pytest", "-q", "-m", "cuda", "--durations=10", "tests")
    for workload, batch in (("w1", 128), ("w2", 4096)):
        extra = ["--json", f"{Path(args.json).with_suffix('')}-{workload}.json"] if args.json else []
        failed |= run("scripts/bench.py", "--device", "cuda", "--workload", workload, "--batch", str(batch),
                      "--steps", "100", "--every", "5", "--rss-steps", "300", *extra)  # fmt: skip
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
