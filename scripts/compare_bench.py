"""How long ``tblog-hooks compare`` takes on a deep model's long run.

Two runs of a GPT-2 of ``--layers`` blocks (50: 304 watched modules) with ``--steps`` logged steps
(500), the tags a real logged step writes (``attention=True``, ``optimizer=``) with varied values
(``scripts/dashboard_bench.py``'s deep run); the second is the first with every value from the
middle step on 1% larger. Prints the wall time of ``tblog-hooks compare`` on the run against a copy
of itself (they agree: every value is compared) and against the second (they part), the reading of
both runs' event files and the comparison alone, each the best of ``--repeat`` (3):

    python scripts/compare_bench.py [--layers 50] [--steps 500]

Needs ``transformers``.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dashboard_bench import write_deep
from tensorboard.compat.proto import event_pb2
from tensorboard.summary.writer.event_file_writer import EventFileWriter

from tblog_hooks.cli import report
from tblog_hooks.diagnostics.compare import compare
from tblog_hooks.output.event_files import read_records


def scaled_copy(source: Path, target: Path, from_step: int, factor: float) -> None:
    """``source``'s events, every scalar at ``from_step`` or later times ``factor``."""
    writer = EventFileWriter(str(target))
    for path in sorted(source.glob("events.out.tfevents.*")):
        for record in read_records(path):
            event = event_pb2.Event.FromString(record)
            if event.step >= from_step:
                for value in event.summary.value:
                    if value.HasField("simple_value"):
                        value.simple_value *= factor
            writer.add_event(event)
    writer.close()


def cli(a: Path, b: Path) -> None:
    """``tblog-hooks compare a b`` in a process of its own (its imports included)."""
    code = "import sys; from tblog_hooks.cli import main; sys.exit(main())"
    subprocess.run([sys.executable, "-c", code, "compare", str(a), str(b)], capture_output=True, check=False)


def best(call: object, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()  # type: ignore[operator]
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=50)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    try:
        modules = write_deep(root / "a", args.layers, args.steps, 1)
        shutil.copytree(root / "a", root / "same")
        scaled_copy(root / "a", root / "b", args.steps // 2, 1.01)
        runs = {name: report.load(root / name, name) for name in ("a", "same", "b")}
        values = sum(len(s) for s in runs["a"].scalars.values())
        print(f"{modules} watched modules, {args.steps} logged steps, {values:,} scalars a run")
        rows = [
            ("`tblog-hooks compare` (agree)", lambda: cli(root / "a", root / "same")),
            ("`tblog-hooks compare` (part)", lambda: cli(root / "a", root / "b")),
            ("reading both runs", lambda: [report.load(root / n, n) for n in ("a", "b")]),
            ("comparing (agree)", lambda: compare(runs["a"], runs["same"])),
            ("comparing (part)", lambda: compare(runs["a"], runs["b"])),
        ]  # fmt: skip
        print("| what | seconds |\n|---|---|")
        for name, call in rows:
            print(f"| {name} | {best(call, args.repeat):.2f} |")
        parted = compare(runs["a"], runs["b"])
        assert parted.first is not None and parted.first.step == args.steps // 2, parted.first
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
