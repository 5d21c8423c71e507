"""The ``tblog-hooks`` command line."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..diagnostics.compare import CompareError, Tolerance
from ..diagnostics.findings import FINDING_KINDS
from ..diagnostics.replay import findings

if TYPE_CHECKING:
    from ..diagnostics.replay import Run

SCENARIOS = ("healthy", "vanishing", "exploding", "dead-relu", "nan")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tblog-hooks", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small model with the logger attached and write runs/")
    demo.add_argument("--logdir", default="runs", help="where to write the TensorBoard run (default: runs)")
    demo.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="healthy",
        help="healthy: ResNet-18 on generated images; the others: a small model showing that problem",
    )
    demo.add_argument(
        "--steps", type=_positive_int, help="optimizer steps (default: 300 for healthy, else the scenario's)"
    )
    demo.add_argument("--every", type=_positive_int, default=10, help="log every N optimizer steps (default: 10)")
    demo.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    report = commands.add_parser("report", help="per-layer table and findings of runs, from their event files")
    report.add_argument("run_dir", help="a run directory, or a folder of runs (each is reported)")
    report.add_argument("--json", action="store_true", help="print one JSON object per run (one per line)")
    report.add_argument("--png", metavar="PATH", help="write the gradient-flow heatmap (several runs: PATH-RUN.png)")
    report.add_argument(
        "--fail-on",
        metavar="KIND[,KIND]",
        help=f"exit 1 when a finding of these kinds exists ({', '.join(FINDING_KINDS)})",
    )
    _add_compare(commands)
    args = parser.parse_args(argv)

    if args.command == "compare":
        from . import compare

        try:
            tolerance = Tolerance(args.rtol, args.atol)
        except CompareError as error:
            parser.error(str(error))
        prefixes = (args.prefix, args.prefix if args.other_prefix is None else args.other_prefix)
        return compare.main(args.a, args.b, prefixes=prefixes, tolerance=tolerance, as_document=args.json)
    if args.command == "report":
        fail_on = set() if args.fail_on is None else {k.strip() for k in args.fail_on.split(",")}
        if fail_on - set(FINDING_KINDS):
            parser.error(
                f"--fail-on got {sorted(fail_on - set(FINDING_KINDS))!r}; valid kinds: {', '.join(FINDING_KINDS)}"
            )
        return _report(args.run_dir, as_json=args.json, png_path=args.png, fail_on=fail_on)

    from .demo import pick_device, run_demo

    run_dir = run_demo(args.logdir, args.scenario, args.steps, args.every, pick_device(args.device))
    print(f"wrote {run_dir}\nopen it with:  {runnable('tensorboard')} --logdir {args.logdir}")
    print(f"or:  {runnable('tblog-hooks')} report {run_dir}")
    return 0


def runnable(script: str) -> str:
    """How to run ``script``, a command installed beside this Python, as printed: its bare name
    where the shell finds that one (an active virtual environment), else its path (relative to
    the working directory where it is under it: ``.venv/bin/tensorboard``)."""
    path = Path(sys.executable).parent / script
    if not path.exists():
        return script
    found = shutil.which(script)
    if found is not None and Path(found).resolve() == path.resolve():
        return script
    return os.path.relpath(path) if path.is_relative_to(Path.cwd()) else str(path)


def _add_compare(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    default = Tolerance()
    compare = commands.add_parser(
        "compare",
        help="where two runs part: the first step and module at which their statistics differ",
        description="Exit 0 when every value both runs hold agrees, 1 when they part, 2 for bad input.",
    )
    compare.add_argument("a", help="a run directory (the reference)")
    compare.add_argument("b", help="the run directory to compare with it")
    compare.add_argument("--prefix", help="the logger's prefix in A (needed when A holds several)")
    compare.add_argument("--other-prefix", help="the logger's prefix in B (default: --prefix)")
    compare.add_argument(
        "--rtol", type=float, default=default.rtol, help=f"relative tolerance (default: {default.rtol:g})"
    )
    compare.add_argument(
        "--atol", type=float, default=default.atol, help=f"absolute tolerance (default: {default.atol:g})"
    )
    compare.add_argument("--json", action="store_true", help="print one JSON object")


def _positive_int(text: str) -> int:
    """argparse type: a usage error (exit 2) for what ``HookLogger`` would reject mid-demo."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _report(path: str, *, as_json: bool, png_path: str | None, fail_on: set[str]) -> int:
    """Report every tblog_hooks run under ``path``; directories without one are named and skipped.
    Exit status: 2 when an event file is damaged or no run could be reported, else 1 when a
    ``fail_on`` finding exists, else 0."""
    from . import report

    try:
        runs, damaged = _load(path)
    except report.ReportError as error:
        _tell(str(error))
        return 2
    failed = False
    for run in runs:
        for before, after in run.restarts:
            _tell(
                f"{run.name}: the logged steps go back from {before} to {after} (a restart into the same "
                f"directory?); from step {after} on, the report shows the later run"
            )
        print(json.dumps(report.as_json(run)) if as_json else report.as_text(run))
        failed |= any(f.kind in fail_on for f in findings(run))
        if png_path is not None:
            target = Path(png_path)
            if len(runs) > 1:
                suffix = "-".join(filter(None, (run.label, run.prefix))).replace("/", "-")
                target = target.with_name(f"{target.stem}-{suffix}{target.suffix or '.png'}")
            try:
                target.write_bytes(report.flow_png(run))
            except (report.ReportError, OSError) as error:
                _tell(str(error))
                return 2
            print(f"wrote {target}", file=sys.stderr)
    if not runs:
        _tell(f"no tblog_hooks run to report under {path!r}")
    return 2 if damaged or not runs else 1 if failed else 0


def _load(path: str) -> tuple[list[Run], bool]:
    """The runs under ``path`` and whether an event file was damaged (each problem told on stderr)."""
    from . import report

    runs: list[Run] = []
    damaged = False
    for run_dir in report.find_runs(path):
        name = report.run_label(run_dir, path)
        try:
            found = report.load_all(run_dir, name)
        except (report.ReportError, OSError) as error:
            _tell(str(error))
            damaged = True
            continue
        if not found:
            _tell(f"skipped {name!r}: no tblog_hooks statistics (written by something else, or no step logged yet)")
        runs += found
    return runs, damaged


def _tell(message: str) -> None:
    """A message about reading the runs, on stderr (stdout holds only the reports)."""
    print(f"tblog-hooks report: {message}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
