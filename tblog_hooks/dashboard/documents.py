"""The JSON documents the dashboard's routes serve, built from what :mod:`.source` read.

Module and parameter names are given unescaped, as the model names them. Values are TensorBoard's
float32 scalars as Python floats, NaN and infinities as the strings ``"NaN"``, ``"Infinity"`` and
``"-Infinity"`` (as TensorBoard's own JSON gives them), and ``None`` (``null``) means "no value at
that step": every document is valid JSON as built (``json.dumps(..., allow_nan=False)``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..diagnostics.findings import MEASURES, FindingKind
from ..diagnostics.numerics_rules import FORMATS
from ..diagnostics.numerics_rules import PICTURES as NUMERICS_ROOTS
from ..diagnostics.replay import owner
from ..stats.tags import (
    GRAD_NORM_TAG,
    HEADS_TABLE_TAG,
    LOSS_TAG,
    NAMED_ROOTS,
    NUMERICS_TABLE_TAG,
    Lost,
    Root,
    Scale,
    Stat,
    escape,
    per_format,
    scale_of,
    tag,
    unescape,
)
from .analyses import Analysis
from .source import Model, in_forward_order, names_of

#: The statistics the page offers first, in this order (then the others a run holds, sorted).
FIRST_ROOTS = (
    tag(Root.GRADIENT, Stat.NORM),
    tag(Root.ACTIVATION, Stat.STD),
    tag(Root.ACTIVATION, Stat.DEAD_FRAC),
    tag(Root.PARAM_GRAD, Stat.NORM),
    tag(Root.PARAM, Stat.UPDATE_RATIO),
    tag(Root.ATTENTION, Stat.MAX_LOGIT),
    tag(Root.ATTENTION, Stat.ENTROPY),
)
#: Finding kinds from the most to the least severe: how the module table ranks its rows.
SEVERITY = (
    FindingKind.NONFINITE,
    FindingKind.EXPLODING_GRADIENT,
    FindingKind.VANISHING_GRADIENT,
    FindingKind.FP16_GRADIENT_UNDERFLOW,
    FindingKind.FP8_OVERFLOW,
    FindingKind.DEAD_UNITS,
    FindingKind.MASSIVE_ACTIVATION,
    FindingKind.LOGIT_DRIFT,
    FindingKind.ATTENTION_LOGIT_GROWTH,
    FindingKind.ATTENTION_ENTROPY_COLLAPSE,
    FindingKind.FP8_UNDERFLOW,
    FindingKind.AMP_SKIPPED_STEPS,
    FindingKind.GRADIENT_SPIKE,
    FindingKind.LOSS_SPIKE,
)
_SPIKE_KINDS = (FindingKind.GRADIENT_SPIKE, FindingKind.LOSS_SPIKE)


def number(value: float | None) -> float | str | None:
    """A value as the documents give it: NaN and infinities as TensorBoard's JSON strings."""
    if value is None or math.isfinite(value):
        return value
    return "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"


def scales() -> dict[str, str]:
    """The ``scales`` document: the scale of each statistic (``dead_frac``), each per-format
    statistic (``underflow_fp16``) and each per-format loss (``underflow``); any other is ``log``."""
    named = {str(stat): scale_of(stat) for stat in Stat} | {str(lost): scale_of(lost) for lost in Lost}
    formats = {per_format(lost, fmt): scale_of(lost) for lost in Lost for fmt in FORMATS}
    return {"default": Scale.LOG} | {name: str(scale) for name, scale in (named | formats).items()}


def kinds() -> dict[str, dict[str, str]]:
    """The ``kinds`` document: for each finding kind, what its ``value`` is (``label``, a few
    words shown beside it, and ``meaning``, the sentence; see
    :data:`~tblog_hooks.diagnostics.findings.MEASURES`)."""
    return {str(kind): measure._asdict() for kind, measure in MEASURES.items()}


def findings(analysis: Analysis) -> list[dict[str, Any]]:
    """The ``findings`` document: those ``tblog-hooks report --json`` gives, in step order, with
    NaN and infinite values as the documents give them (:func:`number`)."""
    return [
        {"kind": f.kind, "module": f.module, "step": f.step, "value": number(f.value), "message": f.message}
        for f in analysis.findings
    ]


def roots(model: Model) -> list[str]:
    """The per-module statistics (``root/stat``) the model holds, those the page offers first first."""
    held = model.roots()
    return [r for r in FIRST_ROOTS if r in held] + [r for r in held if r not in FIRST_ROOTS]


def run_entry(model: Model) -> dict[str, Any]:
    """An entry of the ``runs`` document: ``heads`` and ``numerics`` say whether the run holds the
    per-head and per-format value tables."""
    own = {model.own(t) for t in model.tags}
    return {
        "run": model.run,
        "prefix": model.prefix,
        "name": model.name,
        "stats": roots(model),
        "spikes": GRAD_NORM_TAG in own or LOSS_TAG in own,
        "max_step": model.version[0],
        "heads": HEADS_TABLE_TAG in model.tables,
        "numerics": NUMERICS_TABLE_TAG in model.tables,
    }


def overview(judged: Sequence[tuple[Model, Analysis | Exception]]) -> list[dict[str, Any]]:
    """The ``overview`` document: per model, how many findings of each kind its run holds
    (``kinds``, the most severe first), the most severe (``worst``, ``None`` without findings),
    and how many logged steps they were judged on; worst run first, by its most severe kind
    (:data:`SEVERITY`), then the number of findings, then name. A run whose analysis failed is
    first, with ``error`` saying why (``None`` in every other row) and no counts."""
    rows = []
    for model, analysis in judged:
        row: dict[str, Any] = {"run": model.run, "prefix": model.prefix, "name": model.name}
        if isinstance(analysis, Exception):
            error = f"{type(analysis).__name__}: {analysis}"
            row.update(findings=None, kinds={}, worst=None, logged_steps=None, sampled=False, error=error)
            rows.append(row)
            continue
        counts = {str(k): 0 for k in SEVERITY}
        for f in analysis.findings:
            counts[f.kind] += 1
        kinds = {k: n for k, n in counts.items() if n}
        row.update(
            findings=len(analysis.findings),
            kinds=kinds,
            worst=next(iter(kinds), None),
            logged_steps=len(analysis.run.scalars),
            sampled=analysis.sampled,
            error=None,
        )
        rows.append(row)

    def rank(row: dict[str, Any]) -> tuple[int, int, str]:
        if row["error"] is not None:
            return -1, 0, row["name"]
        worst = len(SEVERITY) if row["worst"] is None else SEVERITY.index(FindingKind(row["worst"]))
        return worst, -row["findings"], row["name"]

    return sorted(rows, key=rank)


#: The axes of each value table after its modules, and how the documents name them.
TABLE_AXES: dict[str, dict[str, list[str]]] = {
    HEADS_TABLE_TAG: {"quantities": [Stat.MAX_LOGIT, Stat.ENTROPY]},
    NUMERICS_TABLE_TAG: {"roots": list(NUMERICS_ROOTS), "formats": list(FORMATS), "quantities": list(Lost)},
}
#: The position of the modules' axis in each value table.
_MODULE_AXIS = {HEADS_TABLE_TAG: 0, NUMERICS_TABLE_TAG: 1}


def value_table(
    model: Model, table: str, by_step: Mapping[int, tuple[list[str], np.ndarray]], step: int | None
) -> dict[str, Any]:
    """The ``heads`` or ``numerics`` document: the value table (:data:`TABLE_AXES`) of one logged
    ``step`` (the latest without one) and every step the run holds it at. ``heads``: ``values[module]
    [head]`` is ``[max_logit, entropy]`` (NaN past the last head of a module with fewer heads than
    the widest); ``numerics``: ``values[root][module][format]`` is ``[underflow, overflow,
    subnormal, floor]`` (``None`` where there is no value: a root the module has none of, fp8's
    subnormals and floor)."""
    axis = _MODULE_AXIS[table]
    steps = [s for s, (names, values) in by_step.items() if values.ndim > axis and len(names) == values.shape[axis]]
    if step is None and steps:
        step = steps[-1]
    doc: dict[str, Any] = {"run": model.run, "prefix": model.prefix, "steps": steps, "step": step}
    doc |= {name: [str(v) for v in labels] for name, labels in TABLE_AXES[table].items()}
    if step not in steps:
        return doc | {"modules": [], "values": []}
    names, values = by_step[step]
    if table == NUMERICS_TABLE_TAG:  # fractions of counts: NaN only where there is no value
        return doc | {"modules": names, "values": _nested(values, np.isnan(values))}
    return doc | {"modules": names, "heads": values.shape[1], "values": _nested(values)}


def _nested(values: np.ndarray, absent: np.ndarray | None = None) -> list[Any]:
    """The array as nested lists of :func:`number` values, ``None`` where ``absent``."""
    flat = [number(float(v)) for v in values.ravel()]
    if absent is not None:
        for i in np.flatnonzero(absent):
            flat[i] = None
    out: list[Any] = flat
    for size in reversed(values.shape[1:]):
        out = [out[i : i + size] for i in range(0, len(out), size)]
    return out


def heatmap(
    model: Model, root: str, values: Mapping[str, Mapping[int, float]], order: list[str], kept: int
) -> dict[str, Any]:
    """The ``heatmap`` document of ``root`` (``gradient/norm``): one row per name in forward
    order, one column per step at which any of them has a value, ``None`` where one has none;
    ``sampled`` when a tag has as many values as TensorBoard keeps of one (``kept``, ``0`` for
    all), so that the steps are its sample of those written."""
    names = names_of(model, root)
    rows = in_forward_order(names.values(), order)
    tag_of = {name: t for t, name in names.items()}
    steps = sorted({step for t in names for step in values.get(t, {})})
    table = [[number(values.get(tag_of[name], {}).get(step)) for step in steps] for name in rows]
    sampled = 0 < kept <= max((len(v) for v in values.values()), default=0)
    doc = {"run": model.run, "prefix": model.prefix, "tag": root, "modules": rows, "steps": steps, "values": table}
    return doc | {"sampled": sampled}


def module_table(analysis: Analysis, histograms: frozenset[str]) -> dict[str, Any]:
    """The ``modules`` document: per watched module, the latest value of each of its statistics,
    the findings naming it (a parameter's findings count for its module) and whether the run
    holds histograms of it or its own parameters (of ``histograms``, the names it has them of), worst first:
    by the most severe finding kind, then the number of findings, then forward order; and how
    many logged steps the findings were judged on, and whether those are TensorBoard's sample."""
    run = analysis.run
    latest: dict[str, float] = {}
    for scalars in run.scalars.values():
        latest.update(scalars)
    values: dict[str, dict[str, float | str | None]] = {m: {} for m in run.order}
    parameters: dict[str, set[str]] = {}
    for full, value in latest.items():
        root, stat, name = _parts(full)
        if name is not None and root in _MODULE_ROOTS:
            values.setdefault(unescape(name), {})[f"{root}/{stat}"] = number(value)
        elif name is not None and root in _PARAMETER_ROOTS:
            parameters.setdefault(unescape(name), set())
    modules = in_forward_order(values, run.order)
    own: dict[str, list[str]] = {}
    for name in sorted(parameters):
        if (held := owner(name, modules)) is not None and held != name:
            own.setdefault(held, []).append(name[len(held) + 1 :])
    found: dict[str, list[str]] = {m: [] for m in modules}
    for finding in analysis.findings:
        if (held := owner(finding.module, modules)) is not None:
            found[held].append(finding.kind)
    position = {m: i for i, m in enumerate(modules)}

    def rank(module: str) -> tuple[int, int, int]:
        worst = min((SEVERITY.index(FindingKind(k)) for k in found[module]), default=len(SEVERITY))
        return worst, -len(found[module]), position[module]

    rows = [
        {
            "module": m,
            "index": position[m],
            "findings": found[m],
            "values": values[m],
            "tag_filter": tag_filter(run.prefix, m, own.get(m, [])),
            "histograms": m in histograms or any(f"{m}.{p}" in histograms for p in own.get(m, [])),
        }
        for m in sorted(modules, key=rank)
    ]
    stats = {stat for row in values.values() for stat in row}
    first = [r for r in FIRST_ROOTS if r in stats]
    return {
        "stats": first + sorted(stats - set(first)),
        "rows": rows,
        "model_tag_filter": tag_filter(run.prefix, None),
        "logged_steps": len(run.scalars),
        "sampled": analysis.sampled,
    }


#: Roots whose names are modules, and those whose names are parameters.
_MODULE_ROOTS = (Root.ACTIVATION, Root.INPUT, Root.GRADIENT, Root.ATTENTION)
_PARAMETER_ROOTS = (Root.PARAM, Root.PARAM_GRAD)


def tag_filter(prefix: str, module: str | None, parameters: Sequence[str] = ()) -> str:
    """TensorBoard's tag filter (a regular expression) for the charts of ``module`` in its Scalars
    and Histograms tabs: its tags and its own ``parameters``' (``root/stat/{name}`` scalars,
    ``root/{name}`` histograms, names escaped as in the tags) under the logger's ``prefix``; for
    ``None``, the whole model's every-step series (``step/*``)."""
    head = f"^{re.escape(prefix)}/" if prefix else "^"
    if module is None:
        return f"{head}{Root.STEP}/"
    names = f"(?:\\.(?:{'|'.join(re.escape(escape(p)) for p in parameters)}))?" if parameters else ""
    return f"{head}[^/]+/(?:[^/]+/)?{re.escape(escape(module))}{names}$"


def _parts(full: str) -> tuple[str, str, str | None]:
    root, _, rest = full.partition("/")
    stat, _, name = rest.partition("/")
    return root, stat, (name if name else None)


def module_series(analysis: Analysis, module: str) -> dict[str, Any]:
    """The ``series`` document: every statistic of one watched module (and of its own parameters)
    over the logged steps, one entry per tag."""
    run = analysis.run
    steps = list(run.scalars)
    found: dict[tuple[str, str], list[float | str | None]] = {}
    for i, scalars in enumerate(run.scalars.values()):
        for full, value in scalars.items():
            root, stat, name = _parts(full)
            if name is None or root not in NAMED_ROOTS:
                continue
            if (named := unescape(name)) == module or owner(named, run.order) == module:
                found.setdefault((f"{root}/{stat}", named), [None] * len(steps))[i] = number(value)
    ordered = sorted(found, key=lambda k: (_root_rank(k[0]), k[1]))
    series = [{"stat": stat, "name": name, "values": found[stat, name]} for stat, name in ordered]
    return {"module": module, "steps": steps, "series": series}


def _root_rank(root: str) -> tuple[int, str]:
    return (FIRST_ROOTS.index(root) if root in FIRST_ROOTS else len(FIRST_ROOTS)), root


def spikes(analysis: Analysis) -> dict[str, Any]:
    """The ``spikes`` document: ``step/grad_norm`` and ``step/loss`` at every step they were
    written, and the spike findings (their steps are marked on the chart)."""
    series = analysis.run.series

    def line(name: str) -> dict[str, list[Any]]:
        points = [(step, values[name]) for step, values in series.items() if name in values]
        return {"steps": [s for s, _ in points], "values": [number(v) for _, v in points]}

    marked = [f for f in findings(analysis) if f["kind"] in _SPIKE_KINDS]
    return {"grad_norm": line(GRAD_NORM_TAG), "loss": line(LOSS_TAG), "spikes": marked}
