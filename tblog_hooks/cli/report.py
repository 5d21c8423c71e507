"""``tblog-hooks report``: per-layer table and health findings of runs on disk.

Reads event files (no training, no model, no torch) and replays them through the same rules the
logger uses (``diagnostics/replay.py``). Each tag prefix in a directory is a run of its own.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from google.protobuf.message import DecodeError
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.util import tensor_util

from ..diagnostics.per_step import gradient_flow_image, gradient_norms
from ..diagnostics.replay import Run, findings, forward_order, is_logged_step, is_series, module_rows
from ..output.event_files import DamagedFile, read_records
from ..output.events import png
from ..stats.tags import ORDER_TAG, TABLE_PLUGIN, Stat, read_order, split_prefix, tensor_names


class ReportError(Exception):
    """A run that cannot be reported: missing or damaged."""


_ORDER = re.compile(rf"(?:(?P<prefix>.+)/)?{re.escape(ORDER_TAG)}(?P<text>/text_summary)?")
_EVENT_FILES = "events.out.tfevents.*"


def find_runs(path: str | os.PathLike[str]) -> list[Path]:
    """Every directory at or below ``path`` that holds event files, sorted."""
    root = Path(path)
    if not root.exists():
        raise ReportError(f"{os.fspath(path)!r} does not exist; pass a run directory or a folder of runs")
    if not root.is_dir():
        raise ReportError(f"{os.fspath(path)!r} is not a directory; pass a run directory or a folder of runs")
    runs = sorted({p.parent for p in root.rglob(_EVENT_FILES) if p.is_file()})
    if not runs:
        raise ReportError(f"no TensorBoard event files ({_EVENT_FILES}) under {os.fspath(path)!r}")
    return runs


def run_label(run_dir: Path, path: str | os.PathLike[str]) -> str:
    """How a run found under ``path`` is named: its path below ``path``, or the directory's own name."""
    root = Path(path)
    return str(run_dir.relative_to(root)) if run_dir != root else (root.resolve().name or str(root.resolve()))


def load(run_dir: Path, label: str) -> Run:
    """The one run in ``run_dir``; raises :class:`ReportError` when it holds none, several
    (loggers with different prefixes: see :func:`load_all`), or a damaged event file."""
    runs = load_all(run_dir, label)
    if len(runs) != 1:
        found = ", ".join(repr(run.name) for run in runs) or "none"
        raise ReportError(f"{str(run_dir)!r} holds {len(runs)} tblog_hooks runs ({found}), not one")
    return runs[0]


def load_all(run_dir: Path, label: str) -> list[Run]:
    """The runs in one directory, one per tag prefix (unprefixed first); empty when it holds no
    logged step of tblog_hooks. Raises :class:`ReportError` for a damaged event file.

    Event files are read in the order they were started (their first event's wall time), each
    in file order. As TensorBoard does (``purge_orphaned_data``), a file that starts with a
    ``SessionLog.START`` at step ``N`` (``SummaryWriter(purge_step=N)``, a logger's
    ``start_step=N``) drops every value of the files before it from step ``N`` on. When a logger's
    steps go back without one, the later ones replace the earlier from the step they restart at
    (as ``purge_step`` would)."""
    files = [_read_file(p) for p in run_dir.glob(_EVENT_FILES) if p.is_file()]
    runs: dict[str, Run] = {}
    orders: dict[str, list[str]] = {}
    texts: dict[str, str] = {}
    for file in sorted(files, key=lambda f: f.start):
        for purge in file.purges:
            for run in runs.values():
                run.scalars = {s: v for s, v in run.scalars.items() if s < purge}
                run.series = {s: v for s, v in run.series.items() if s < purge}
        orders |= file.orders
        texts |= file.texts
        for step, prefix, scalars in file.series:
            runs.setdefault(prefix, Run(label, prefix, {}, [])).series.setdefault(step, {}).update(scalars)
        for step, prefix, scalars in file.steps:
            run = runs.setdefault(prefix, Run(label, prefix, {}, []))
            last = next(reversed(run.scalars), None)  # steps are kept in increasing order
            if last is not None and step <= last:
                run.restarts.append((last, step))
                run.scalars = {s: v for s, v in run.scalars.items() if s < step}
            run.scalars[step] = scalars
    for prefix, run in runs.items():
        written = orders[prefix] if prefix in orders else read_order(texts.get(prefix, ""))
        run.order = forward_order(written, set().union(*run.scalars.values()))
    return [runs[prefix] for prefix in sorted(runs)]


@dataclass
class _EventFile:
    start: tuple[float, str]  # first event's wall time, then the name: the order files were started in
    steps: list[tuple[int, str, dict[str, float]]]  # (step, prefix, scalars) of each logged step, in file order
    orders: dict[str, list[str]]  # the latest forward order of each prefix
    #: The latest forward order of each prefix as text, of runs written before it was a tensor.
    texts: dict[str, str] = field(default_factory=dict)
    series: list[tuple[int, str, dict[str, float]]] = field(default_factory=list)  # (step, prefix, values)
    purges: list[int] = field(default_factory=list)  # the steps of its SessionLog.START events (before its values)


def _read_file(path: Path) -> _EventFile:
    """The logged steps and forward orders of one event file (other tags are left out)."""
    file = _EventFile((math.inf, path.name), [], {})
    plans: dict[tuple[str, ...], _Plan] = {}
    try:
        for record in read_records(path):
            event = event_pb2.Event.FromString(record)
            file.start = min(file.start, (event.wall_time, path.name))
            if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                file.purges.append(event.step)
            values = event.summary.value
            plan = _plan(values, plans)
            numbers = [v.simple_value for v in values]
            by_prefix = {
                prefix: dict(zip(own, map(numbers.__getitem__, at), strict=True)) for prefix, own, at in plan.scalars
            }
            for prefix, i in plan.orders:
                file.orders[prefix] = tensor_names(tensor_util.make_ndarray(values[i].tensor))
            for prefix, i in plan.texts:
                if values[i].tensor.string_val:
                    file.texts[prefix] = values[i].tensor.string_val[0].decode("utf-8", "replace")
            file.steps += [
                (event.step, prefix, scalars) for prefix, scalars in by_prefix.items() if is_logged_step(scalars)
            ]
            file.series += [
                (event.step, prefix, scalars) for prefix, scalars in by_prefix.items() if is_series(scalars)
            ]
    except (DamagedFile, DecodeError) as error:
        raise ReportError(f"{str(path)!r} is damaged: {error} (what follows cannot be trusted)") from None
    return file


@dataclass(frozen=True)
class _Plan:
    """Where an event's values go: per prefix, its scalars' own tags and their positions; the
    positions of forward orders, as tensors and as text (of runs written before the tensors)."""

    scalars: list[tuple[str, list[str], list[int]]]
    orders: list[tuple[str, int]]
    texts: list[tuple[str, int]]


def _plan(values: Sequence[summary_pb2.Summary.Value], plans: dict[tuple[str, ...], _Plan]) -> _Plan:
    """The plan of an event's values: made once per sequence of tags, kept in ``plans`` (one file's:
    a logger writes the same tags at every logged step, so its events share a few plans)."""
    tags = tuple(v.tag for v in values)
    plan = plans.get(tags)
    if plan is None:
        by_prefix: dict[str, tuple[list[str], list[int]]] = {}
        orders: list[tuple[str, int]] = []
        texts: list[tuple[str, int]] = []
        for i, value in enumerate(values):
            if value.HasField("simple_value") and (split := split_prefix(value.tag)):
                own, at = by_prefix.setdefault(split[0], ([], []))
                own.append(split[1])
                at.append(i)
            elif match := _ORDER.fullmatch(value.tag):
                if match["text"]:
                    texts.append((match["prefix"] or "", i))
                elif _of_plugin(value):
                    orders.append((match["prefix"] or "", i))
        plan = plans[tags] = _Plan([(p, own, at) for p, (own, at) in by_prefix.items()], orders, texts)
    return plan


def _of_plugin(value: summary_pb2.Summary.Value) -> bool:
    """Whether a value is a tensor of the dashboard plugin's (the forward order, the value tables)."""
    return bool(value.HasField("tensor") and value.metadata.plugin_data.plugin_name == TABLE_PLUGIN)


def as_json(run: Run) -> object:
    """The ``--json`` document of one run (NaN/Inf become null)."""
    return _json_safe({
        "run": run.name,
        "steps": list(run.scalars),
        "modules": module_rows(run),
        "findings": [asdict(f) for f in findings(run)],
    })  # fmt: skip


def as_text(run: Run) -> str:
    """The per-layer table and the findings, for a terminal."""
    steps = list(run.scalars)
    lines = [f"run {run.name}: {len(steps)} logged steps ({steps[0]}..{steps[-1]})" if steps else f"run {run.name}"]
    header = ("module", "grad norm", "min", "latest/first", "dead frac", "NaN/Inf")
    table = [header] + [
        (
            str(r["module"]),
            _number(r["grad_norm_latest"]),
            _number(r["grad_norm_min"]),
            _number(r["grad_norm_trend"]),
            _number(r[Stat.DEAD_FRAC]),
            f"{r['nonfinite']:.0f}",
        )
        for r in module_rows(run)
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        lines.append(
            "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        )
    found = findings(run)
    lines.append(f"findings: {len(found)}" if found else "findings: none")
    lines += [f"  step {f.step}: {f.kind} [{f.module}] {f.message}" for f in found]
    return "\n".join(lines)


def flow_png(run: Run) -> bytes:
    """The gradient-flow heatmap of the run as PNG bytes."""
    norms = {step: gradient_norms(scalars) for step, scalars in run.scalars.items()}
    norms = {step: by_module for step, by_module in norms.items() if by_module}
    if not norms:
        raise ReportError(f"run {run.name!r} has no output-gradient norms (gradient/norm/...) to draw")
    return png(gradient_flow_image(run.order, norms))


def _number(value: object) -> str:
    return "-" if value is None else f"{value:.3g}"


def _json_safe(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value
