"""``tblog-hooks report``: per-layer table and health findings of runs on disk.

Reads event files with TensorBoard's own reader (no training, no model) and replays the
logged scalars through the same :class:`~tblog_hooks.health.Health` the logger uses, with
the default :class:`~tblog_hooks.health.Thresholds`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tensorboard.backend.event_processing import event_accumulator

from .diagnose import ORDER_TAG, gradient_flow_image, gradient_norms, parse_order
from .health import Finding, Health, Thresholds, log
from .tags import tag, unescape


class ReportError(Exception):
    """A run that cannot be reported: missing, empty, corrupt or not written by tblog_hooks."""


@dataclass
class Run:
    """The scalars of one run directory, by step, and its watched modules in forward order."""

    name: str
    scalars: dict[int, dict[str, float]]
    order: list[str]


def find_runs(path: str | os.PathLike[str]) -> list[Path]:
    """Every directory at or below ``path`` that holds event files, sorted."""
    root = Path(path)
    if not root.is_dir():
        raise ReportError(f"{os.fspath(path)!r} is not a directory; pass a run directory or a folder of runs")
    runs = sorted({p.parent for p in root.rglob("events.out.tfevents.*") if p.is_file()})
    if not runs:
        raise ReportError(f"no TensorBoard event files (events.out.tfevents.*) under {os.fspath(path)!r}")
    return runs


def load(run_dir: Path, name: str) -> Run:
    """Read a run; raises :class:`ReportError` when it holds no tblog_hooks statistics."""
    acc = event_accumulator.EventAccumulator(
        str(run_dir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    try:
        acc.Reload()
        tags = acc.Tags()
        scalars: dict[int, dict[str, float]] = {}
        for tag in tags["scalars"]:
            for event in acc.Scalars(tag):
                scalars.setdefault(event.step, {})[tag] = event.value
        text_tag = f"{ORDER_TAG}/text_summary"
        order_text = acc.Tensors(text_tag)[-1].tensor_proto.string_val[0] if text_tag in tags["tensors"] else b""
    except Exception as error:  # the reader's errors on damaged files vary; all mean the same to a user
        raise ReportError(f"cannot read the event files in {str(run_dir)!r}: {type(error).__name__}: {error}") from None
    if not any(t.startswith(("gradient/", "activation/", "param_grad/")) for t in tags["scalars"]):
        raise ReportError(
            f"{str(run_dir)!r} has no tblog_hooks statistics (no gradient/, activation/ or param_grad/ "
            "scalars): the event files are empty, damaged, or written by something else"
        )
    order = parse_order(order_text.decode("utf-8", "replace"))
    named = sorted(
        {unescape(t.split("/", 2)[2]) for t in tags["scalars"] if t.startswith(("gradient/norm/", "activation/mean/"))}
    )
    order += [m for m in named if m not in order]
    return Run(name, dict(sorted(scalars.items())), order)


def findings(run: Run, thresholds: Thresholds | None = None) -> list[Finding]:
    """Every finding that starts in the run, in step order."""
    health = Health(thresholds or Thresholds())
    log.disabled = True  # the report prints them itself
    try:
        for step, scalars in run.scalars.items():
            health.update(step, scalars, run.order)
    finally:
        log.disabled = False
    return health.started


def module_rows(run: Run) -> list[dict[str, object]]:
    """Per watched module: output-gradient norm (latest, minimum, latest/first), latest dead
    fraction, and NaN/Inf counted over the run (outputs and output gradients)."""
    rows: list[dict[str, object]] = []
    for m in run.order:
        norm_tag, dead_tag = tag("gradient", "norm", m), tag("activation", "dead_frac", m)
        norms = [s[norm_tag] for s in run.scalars.values() if norm_tag in s]
        dead = [s[dead_tag] for s in run.scalars.values() if dead_tag in s]
        bad = sum(
            s.get(tag("activation", "nonfinite", m), 0.0) + s.get(tag("gradient", "nonfinite", m), 0.0)
            for s in run.scalars.values()
        )
        rows.append({
            "module": m,
            "grad_norm_latest": norms[-1] if norms else None,
            "grad_norm_min": min(norms) if norms else None,
            "grad_norm_trend": norms[-1] / norms[0] if norms and norms[0] > 0 else None,
            "dead_frac": dead[-1] if dead else None,
            "nonfinite": bad,
        })  # fmt: skip
    return rows


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
            _number(r["dead_frac"]),
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
    from .pictures import png

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
