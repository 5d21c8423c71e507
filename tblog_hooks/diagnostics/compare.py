"""Where two runs part: ``tblog-hooks compare`` and the dashboard's ``compare`` route. Host-side
only, no torch.

Two runs read back as :class:`~tblog_hooks.diagnostics.replay.Run` are compared value by value:
every per-module and per-parameter statistic both hold, at every logged step both hold, and the
every-step series of ``spikes=`` (``step/loss``, ``step/grad_norm``) at every step both hold. Two
values differ when ``|a - b| > atol + rtol * max(|a|, |b|)``, or when one is finite and the other
is not (NaN against NaN, and an infinity against the same infinity, are equal).

Where they part is the earliest logged step at which a statistic differs, and within it the
module where the difference starts: the first in forward order whose forward statistics (outputs,
inputs, attention) differ; when none does, the last in forward order whose backward statistics
(output gradients, parameter gradients, update ratios) differ, where backward starts. A
parameter's statistics count for its module.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..stats.tags import GRAD_NORM_TAG, LOSS_TAG, Root, Stat, unescape
from .replay import Run, forward_key, owner

#: Statistics measured in the forward pass; the other named roots come from backward and the optimizer step.
FORWARD_ROOTS = (Root.ACTIVATION, Root.INPUT, Root.ATTENTION)
BACKWARD_ROOTS = (Root.GRADIENT, Root.PARAM_GRAD, Root.PARAM)
_FORWARD = tuple(f"{r}/" for r in FORWARD_ROOTS)
_NAMED = (*_FORWARD, *(f"{r}/" for r in BACKWARD_ROOTS))
#: The statistic a difference is told by, when several of a module differ: the first of these
#: (scale statistics, which round-off moves least), then the others by name; among equals, the largest.
TOLD_BY = (Stat.NORM, Stat.STD, Stat.RMS, Stat.AMAX, Stat.MAX, Stat.MIN, Stat.MEDIAN_ABS, Stat.MEAN)
#: The every-step series of ``spikes=`` compared, by the name the documents give them.
SERIES = {"loss": LOSS_TAG, "grad_norm": GRAD_NORM_TAG}
#: How many modules the text lists (the JSON document lists all).
LISTED = 10


class CompareError(Exception):
    """Two runs that cannot be compared (no logged step in common) or a tolerance that is not one."""


@dataclass(frozen=True)
class Tolerance:
    """When two values differ: ``|a - b| > atol + rtol * max(|a|, |b|)``."""

    rtol: float = 1e-3
    atol: float = 0.0

    def __post_init__(self) -> None:
        for name in ("rtol", "atol"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise CompareError(f"{name} must be a finite number >= 0, got {value!r}")

    def differ(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Where ``a`` and ``b`` differ (element-wise)."""
        with np.errstate(invalid="ignore", over="ignore"):
            close = np.abs(a - b) <= self.atol + self.rtol * np.maximum(np.abs(a), np.abs(b))
            same = (a == b) | (np.isnan(a) & np.isnan(b))
        differ: np.ndarray = ~(same | (close & np.isfinite(a) & np.isfinite(b)))
        return differ


@dataclass(frozen=True)
class Difference:
    """A value that differs: at ``step``, of ``stat`` (the tag, as the runs write it, without the
    prefix) of ``module`` (``None`` for a series of the whole model); ``rel`` is
    ``|a - b| / max(|a|, |b|)`` (infinite where one is not finite)."""

    step: int
    module: str | None
    stat: str
    a: float
    b: float
    rel: float

    @property
    def forward(self) -> bool:
        """Whether the statistic is measured in the forward pass."""
        return self.stat.startswith(_FORWARD)


@dataclass
class Comparison:
    """What :func:`compare` found."""

    a: str  # the runs' names
    b: str
    common_steps: int  # logged steps both hold
    only: tuple[int, int]  # logged steps only a, only b holds (skipped)
    compared: int  # values compared, the series' included
    first: Difference | None  # where the logged statistics part
    modules: list[Difference]  # each module's first difference, by step then forward order
    per_step: dict[str, Difference | None] = field(default_factory=dict)  # each series' first difference
    series_steps: dict[str, int] = field(default_factory=dict)  # the steps each series was compared at
    tolerance: Tolerance = Tolerance()

    @property
    def diverged(self) -> bool:
        """Whether any value differs."""
        return self.first is not None or any(d is not None for d in self.per_step.values())


@dataclass(frozen=True)
class _Layout:
    """The tags two runs share at a step, by module in forward order, and what each tag is."""

    tags: list[str]
    modules: list[str]  # each tag's module (a parameter's: its own)
    position: np.ndarray  # each tag's module's position in forward order
    forward: np.ndarray  # whether each tag is a forward statistic
    ids: np.ndarray  # each tag's module's number (see :class:`_Layouts`)
    told: np.ndarray  # each tag's rank in telling a module's difference (:data:`TOLD_BY`; lower first)


def compare(a: Run, b: Run, tolerance: Tolerance = Tolerance()) -> Comparison:
    """Compare two runs (see the module's docstring); raises :class:`CompareError` when they have
    no logged step in common."""
    common = sorted(a.scalars.keys() & b.scalars.keys())
    if not common:
        raise CompareError(
            f"{a.name!r} and {b.name!r} have no logged step in common: {a.name!r} logged {_span(a.scalars)}, "
            f"{b.name!r} {_span(b.scalars)}"
        )
    layouts = _Layouts(a.order)
    compared, first, found = 0, None, {}
    for step in common:
        sa, sb = a.scalars[step], b.scalars[step]
        layout = layouts.of(sa.keys() & sb.keys())
        va, vb = _values(sa, layout.tags), _values(sb, layout.tags)
        compared += len(layout.tags)
        where = np.flatnonzero(tolerance.differ(va, vb))
        if not where.size:
            continue
        rel = _relative(va[where], vb[where])
        if first is None:
            first = _first(step, layout, where, rel, va, vb)
        new = layouts.unseen(layout, where)
        for module, i, r in sorted(
            zip((layout.modules[j] for j in where[new]), where[new], rel[new], strict=True),
            key=lambda x: (x[0], not layout.forward[x[1]], layout.told[x[1]], -x[2]),
        ):
            if module not in found:
                found[module] = _difference(step, layout, i, va, vb, r)
                layouts.seen(module)
    key = forward_key(a.order)
    comparison = Comparison(
        a.name,
        b.name,
        len(common),
        (len(a.scalars) - len(common), len(b.scalars) - len(common)),
        compared,
        first,
        sorted(found.values(), key=lambda d: (d.step, key(d.module or ""))),
        tolerance=tolerance,
    )
    for name, series_tag in SERIES.items():
        comparison.per_step[name], comparison.series_steps[name] = _series(a.series, b.series, series_tag, tolerance)
        comparison.compared += comparison.series_steps[name]
    return comparison


class _Layouts:
    """The layout of each set of shared tags (most steps share the last one's), and which modules
    already differed."""

    def __init__(self, order: Sequence[str]) -> None:
        self._order = order
        self._key = forward_key(order)
        self._position = {m: i for i, m in enumerate(order)}
        self._last: tuple[set[str], _Layout] | None = None
        self._ids: dict[str, int] = {}  # a number per module
        self._differed = np.zeros(0, dtype=bool)  # by module number

    def of(self, shared: set[str]) -> _Layout:
        if self._last is not None and self._last[0] == shared:
            return self._last[1]
        tags = sorted((t for t in shared if t.startswith(_NAMED) and t.count("/") == 2), key=self._tag_key)
        modules = [self._module(t) for t in tags]
        for m in modules:
            self._ids.setdefault(m, len(self._ids))
        self._differed = np.concatenate([self._differed, np.zeros(len(self._ids) - len(self._differed), dtype=bool)])
        layout = _Layout(
            tags,
            modules,
            np.array([self._position.get(m, len(self._order)) for m in modules], dtype=np.int64),
            np.array([t.startswith(_FORWARD) for t in tags], dtype=bool),
            np.array([self._ids[m] for m in modules], dtype=np.int64),
            np.array([_told(t) for t in tags], dtype=np.int64),
        )
        self._last = (shared, layout)
        return layout

    def unseen(self, layout: _Layout, where: np.ndarray) -> np.ndarray:
        """Which of the tags at ``where`` belong to modules that did not differ before."""
        unseen: np.ndarray = ~self._differed[layout.ids[where]]
        return unseen

    def seen(self, module: str) -> None:
        self._differed[self._ids[module]] = True

    def _module(self, full: str) -> str:
        name = unescape(full.rsplit("/", 1)[1])
        return owner(name, self._order) or name

    def _tag_key(self, full: str) -> tuple[object, ...]:
        return (self._key(self._module(full)), full)


_ORDINALS = sorted(Stat, key=lambda s: (s not in TOLD_BY, TOLD_BY.index(s) if s in TOLD_BY else 0, s))
_RANK = {str(s): i for i, s in enumerate(_ORDINALS)}


def _told(full: str) -> int:
    """The tag's rank in :data:`TOLD_BY` (statistics named per format, ``underflow_fp16``, after all)."""
    return _RANK.get(full.split("/")[1], len(_RANK))


def _values(scalars: Mapping[str, float], tags: list[str]) -> np.ndarray:
    return np.fromiter((scalars[t] for t in tags), dtype=np.float64, count=len(tags))


def _relative(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``|a - b| / max(|a|, |b|)``, infinite where either is not finite (only where they differ: never 0/0)."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        rel = np.abs(a - b) / np.maximum(np.abs(a), np.abs(b))
    return np.where(np.isfinite(a) & np.isfinite(b), rel, np.inf)


def _first(
    step: int, layout: _Layout, where: np.ndarray, rel: np.ndarray, va: np.ndarray, vb: np.ndarray
) -> Difference:
    """Where the difference starts at its first step: the first module in forward order whose
    forward statistics differ, else the last whose backward ones do; told by :data:`TOLD_BY`."""
    forward = layout.forward[where]
    side = forward if forward.any() else ~forward
    positions = layout.position[where]
    module = positions[side].min() if forward.any() else positions[side].max()
    chosen = np.flatnonzero(side & (positions == module))
    best = min(chosen, key=lambda i: (layout.told[where[i]], -rel[i]))
    return _difference(step, layout, where[best], va, vb, rel[best])


def _difference(step: int, layout: _Layout, i: int, va: np.ndarray, vb: np.ndarray, rel: float) -> Difference:
    return Difference(step, layout.modules[i], layout.tags[i], float(va[i]), float(vb[i]), float(rel))


def _series(
    a: Mapping[int, Mapping[str, float]], b: Mapping[int, Mapping[str, float]], tag: str, tolerance: Tolerance
) -> tuple[Difference | None, int]:
    """The first step at which an every-step series differs, and how many steps both hold it at."""
    steps = sorted(s for s in a.keys() & b.keys() if tag in a[s] and tag in b[s])
    va = np.array([a[s][tag] for s in steps], dtype=np.float64)
    vb = np.array([b[s][tag] for s in steps], dtype=np.float64)
    where = np.flatnonzero(tolerance.differ(va, vb))
    if not where.size:
        return None, len(steps)
    i = where[0]
    rel = float(_relative(va[i : i + 1], vb[i : i + 1])[0])
    return Difference(steps[i], None, tag, float(va[i]), float(vb[i]), rel), len(steps)


def _span(scalars: Mapping[int, object]) -> str:
    steps = sorted(scalars)
    return f"{len(steps)} steps ({steps[0]}..{steps[-1]})" if steps else "no step"


def as_json(comparison: Comparison) -> dict[str, object]:
    """The ``--json`` document (the dashboard's ``compare`` route answers it too); NaN/Inf are ``null``."""

    def entry(d: Difference | None, *keys: str) -> dict[str, object] | None:
        return None if d is None else {k: _finite(getattr(d, k)) for k in keys}

    values = ("step", "module", "stat", "a", "b", "rel")
    return {
        "a": comparison.a,
        "b": comparison.b,
        "common_steps": comparison.common_steps,
        "compared": comparison.compared,
        "diverged": comparison.diverged,
        "first": entry(comparison.first, *values),
        "modules": [entry(d, "module", "step", "stat", "a", "b", "rel") for d in comparison.modules],
        "per_step": {name: entry(d, "step", "a", "b", "rel") for name, d in comparison.per_step.items()},
    }


def _finite(value: object) -> object:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def as_text(comparison: Comparison) -> str:
    """What ``tblog-hooks compare`` prints."""
    c, tol = comparison, comparison.tolerance
    only_a, only_b = c.only
    lines = [
        f"{c.a} against {c.b}: {c.common_steps} logged steps in common, {c.compared:,} values compared "
        f"(rtol={tol.rtol:g}, atol={tol.atol:g})",
    ]
    if only_a or only_b:
        lines.append(f"skipped: {only_a} logged steps only {c.a} holds, {only_b} only {c.b} holds")
    if c.first is None:
        lines.append("the logged statistics agree")
    else:
        side = "forward" if c.first.forward else "backward"
        lines.append(f"they part at step {c.first.step} in {c.first.module} ({side}): {_value(c.first)}")
        lines.append(f"modules by the first step they differ at ({min(LISTED, len(c.modules))} of {len(c.modules)}):")
        lines += [f"  step {d.step}  {d.module}  {_value(d)}" for d in c.modules[:LISTED]]
    for name, tag in SERIES.items():
        d = c.per_step.get(name)
        if d is not None:
            lines.append(f"{tag} first differs at step {d.step}: {_value(d)}")
        elif c.series_steps.get(name):
            lines.append(f"{tag} agrees at the {c.series_steps[name]} steps both runs hold")
    lines.append("the runs part" if c.diverged else "every common value agrees")
    return "\n".join(lines)


def _value(d: Difference) -> str:
    return f"{d.stat} {d.a:.6g} against {d.b:.6g} (relative difference {d.rel:.3g})"
