"""``tblog-hooks compare``: where two runs on disk part (see :mod:`tblog_hooks.diagnostics.compare`).

Reads event files as ``tblog-hooks report`` does (no training, no model, no torch).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ..diagnostics.compare import CompareError, Tolerance, as_json, as_text, compare
from ..diagnostics.replay import Run
from . import report


def main(a: str, b: str, *, prefixes: tuple[str | None, str | None], tolerance: Tolerance, as_document: bool) -> int:
    """Compare run directory ``a`` with ``b``: exit 0 when every common value agrees, 1 when the
    runs part, 2 for bad input (told on stderr)."""
    try:
        comparison = compare(load(a, prefixes[0]), load(b, prefixes[1]), tolerance)
    except (report.ReportError, CompareError, OSError) as error:
        print(f"tblog-hooks compare: {error}", file=sys.stderr)
        return 2
    print(json.dumps(as_json(comparison)) if as_document else as_text(comparison))
    return 1 if comparison.diverged else 0


def load(path: str, prefix: str | None) -> Run:
    """The run of the logger with ``prefix`` in the directory ``path`` (without one: its only
    logger); raises :class:`~tblog_hooks.cli.report.ReportError` naming what was wrong and what is valid."""
    below = report.find_runs(path)  # it exists, is a directory and holds event files
    runs = {run.prefix: run for run in report.load_all(Path(path), path)}
    if not runs:
        inside = [str(d.relative_to(path)) for d in below if d != Path(path)]
        hint = f"; the run directories below it: {', '.join(inside)}" if inside else ""
        raise report.ReportError(
            f"{path!r} holds no tblog_hooks statistics (written by something else, or no step logged yet){hint}"
        )
    held = ", ".join(repr(p) for p in runs)
    if prefix is None and len(runs) > 1:
        raise report.ReportError(f"{path!r} holds the loggers of the prefixes {held}: choose one with --prefix")
    chosen = next(iter(runs)) if prefix is None else prefix
    if chosen not in runs:
        raise report.ReportError(f"{path!r} holds no logger with the prefix {chosen!r}; it holds {held}")
    return runs[chosen]
