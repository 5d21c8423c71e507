"""The CUDA check, one command, saying how long each part took: every CUDA test of the suite (the
tests marked ``cuda``: each one ``conftest.needs_cuda`` skips without a device); the two paths of
the statistics (``TBLOG_HOOKS_KERNELS=torch`` and ``triton``) on W1, W2 and a small GPT-2, each
without and with ``numerics=True``: the CUDA kernels a logged step adds per watched tensor
(torch.profiler's count) and the logged step's time over a step without the logger; then the
overhead benchmark on CUDA with larger batches and the cost of ``numerics=True`` on a logged step
(``bench.py --numerics``), printed as Markdown tables. Without a CUDA device it says so and
exits 0: there is nothing to check.

    pip install --no-deps -e . && python scripts/cuda_check.py [--json cuda_bench.json]
    python scripts/cuda_check.py --paths-only      # the two paths' table alone (a few minutes)
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: The workloads of the two paths' table: bench.py's W1 and W2, and its 4-layer GPT-2.
PATH_WORKLOADS = ("w1", "w2", "gpt2")


def run(*args: str) -> int:
    print("+", " ".join(args), flush=True)
    start = time.perf_counter()
    failed = subprocess.call([sys.executable, *args], cwd=ROOT)
    print(f"({time.perf_counter() - start:.0f} s)", flush=True)
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write each benchmark's results to <stem>-<workload>.json")
    parser.add_argument("--paths-only", action="store_true", help="only the torch / triton paths' table")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: the CUDA check is skipped")
        return 0
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    if args.paths_only:
        print(paths_table(torch.device("cuda")), flush=True)
        return 0
    start = time.perf_counter()
    failed = run("-m", "pytest", "-q", "-m", "cuda", "--durations=10", "tests")
    print(paths_table(torch.device("cuda")), flush=True)
    for workload, batch in (("w1", 128), ("w2", 4096)):
        extra = ["--json", f"{Path(args.json).with_suffix('')}-{workload}.json"] if args.json else []
        failed |= run("scripts/bench.py", "--device", "cuda", "--workload", workload, "--batch", str(batch),
                      "--steps", "100", "--every", "5", "--rss-steps", "300", *extra)  # fmt: skip
    extra = ["--json", f"{Path(args.json).with_suffix('')}-numerics.json"] if args.json else []
    failed |= run("scripts/bench.py", "--device", "cuda", "--numerics", "--steps", "40", "--block", "10", *extra)
    print(f"the CUDA check took {time.perf_counter() - start:.0f} s", flush=True)
    return failed


def _workload(name: str, device: object) -> tuple[object, Callable[[], object]]:
    """A workload of ``scripts/bench.py`` and its loss."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    if name == "gpt2":
        return bench.attention_workload(name, device)
    return bench.numerics_workload(name, device)


def _step(model: object, loss: Callable[[], object], opt: object, hooks: object | None) -> None:
    loss().backward()  # type: ignore[attr-defined]
    opt.step()  # type: ignore[attr-defined]
    opt.zero_grad()  # type: ignore[attr-defined]
    if hooks is not None:
        hooks.step()  # type: ignore[attr-defined]


def _kernels(run: Callable[[], None]) -> int:
    """CUDA kernels (and copies) ``run`` launches, by torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _median_time(run: Callable[[], None], steps: int, device: object) -> float:
    import torch

    times = []
    for _ in range(steps):
        torch.cuda.synchronize(device)  # type: ignore[arg-type]
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device)  # type: ignore[arg-type]
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def paths_table(device: object, steps: int = 20) -> str:
    """Per workload and path: CUDA kernels a logged step adds per watched tensor (the outputs and
    output gradients of the watched modules; ``every=1``, no histograms) and the median logged
    step over the median step without the logger; then the seconds the table took."""
    start = time.perf_counter()
    rows = ["| workload | path | kernels added per logged step | per watched tensor | logged step | ratio |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for name in PATH_WORKLOADS:
        rows += _path_rows(name, device, steps)
    return "\n".join([*rows, f"({time.perf_counter() - start:.0f} s)"])


def _path_rows(name: str, device: object, steps: int) -> list[str]:
    import torch

    from tblog_hooks import HookLogger
    from tblog_hooks.kernels import VARIABLE

    model, loss = _workload(name, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # type: ignore[attr-defined]
    bare = functools.partial(_step, model, loss, opt, None)
    for _ in range(3):
        bare()
    bare_kernels, bare_time = _kernels(bare), _median_time(bare, steps, device)
    rows = []
    for path in ("torch", "triton"):
        os.environ[VARIABLE] = path
        for numerics in (False, True):
            log_dir = tempfile.mkdtemp()
            with HookLogger(model, log_dir=log_dir, every=1, histograms=False, numerics=numerics) as hooks:  # type: ignore[arg-type]
                logged = functools.partial(_step, model, loss, opt, hooks)
                for _ in range(3):  # the kernels compile, the caches fill
                    logged()
                added = _kernels(logged) - bare_kernels
                logged_time = _median_time(logged, steps, device)
                tensors = 2 * len(hooks.module_names)
            label = f"{path}, numerics=True" if numerics else path
            rows.append(f"| {name} | {label} | {added} | {added / tensors:.1f} | {logged_time * 1e3:.2f} ms | "
                        f"{logged_time / bare_time:.2f}x |")  # fmt: skip
        os.environ.pop(VARIABLE)
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
