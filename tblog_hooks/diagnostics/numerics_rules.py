"""The low-precision findings (``numerics=``): ``fp16_gradient_underflow``, ``fp8_underflow``,
``fp8_overflow`` and ``massive_activation``, from one logged step's scalars; and the modules x
formats pictures of every format's fractions, and the table of their numbers the dashboard draws.

Host-side only. A per-format rule judges a step only where its format's scalars are written
(``numerics=`` names it, or the run trains in it), so a float32 or bf16 run is not told what fp16
or fp8 would lose unless it asks; ``massive_activation`` judges every step with ``numerics=``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from ..output.summary import Heads
from ..stats.formats import BACKWARD, FORWARD, NAMES, SPECS
from ..stats.tags import (
    NUMERICS_TABLE_TAG,
    SCALE_TAG,
    Axis,
    Indexed,
    Lost,
    Root,
    Stat,
    by_name,
    names_tensor,
    per_format,
    rows_tag,
    tag,
)
from . import pictures
from .findings import FP8_OVERFLOW, FP8_UNDERFLOW, FP16_UNDERFLOW, MASSIVE, Candidates, Finding, Thresholds

#: What the modules x formats pictures show, and their image tags.
PICTURES = {Root.ACTIVATION: "fraction of the output", Root.GRADIENT: "fraction of the output gradient"}
PICTURE_TAGS = {
    Root.ACTIVATION: tag(Root.HEALTH, "numerics_activation"),
    Root.GRADIENT: tag(Root.HEALTH, "numerics_gradient"),
}
#: fp16's largest finite value.
FP16_MAX = SPECS["fp16"].max
#: The formats of the picture's columns, in order.
FORMATS = NAMES


class Cast(NamedTuple):
    """One cast fp8 training makes of each Linear: what the finding calls the tensor, its tag
    root, its format, its tag's name after the Linear's, the axis its scales are taken along
    (:class:`~tblog_hooks.stats.tags.Axis`; ``None``: per tensor, or per row for the input and
    weight under ``fp8_scaling="rowwise"``) and how the finding says it is scaled."""

    tensor: str
    root: Root
    fmt: str
    suffix: str
    axis: Axis | None
    scaled: str

    def stat(self, lost: Lost) -> str:
        """The statistic of what this cast loses."""
        return per_format(lost, self.fmt, self.axis)


_AS_NAMED = "per tensor, or per row with fp8_scaling='rowwise'"
#: What fp8 training (torchao, Transformer Engine) casts of each Linear: its input and weight to
#: e4m3 (forward), its output gradient to e5m2 per tensor (backward).
FP8 = (
    Cast("input", Root.INPUT, FORWARD, "", None, _AS_NAMED),
    Cast("weight", Root.PARAM, FORWARD, ".weight", None, _AS_NAMED),
    Cast("output gradient", Root.GRADIENT, BACKWARD, "", None, "per tensor"),
)
#: Under torchao's rowwise recipe (judged where a step has its gradient casts' tags), the output
#: gradient cast to e4m3 twice instead: per row for grad_input, per column for grad_weight.
FP8_ROWWISE = (
    *(c._replace(scaled="per row") for c in FP8[:2]),
    Cast("output gradient", Root.GRADIENT, FORWARD, "", Axis.ROWS, "per row, for grad_input = grad_output @ W"),
    Cast(
        "output gradient", Root.GRADIENT, FORWARD, "", Axis.COLUMNS,
        "per column over every token, for grad_weight = grad_output.T @ input",
    ),
)  # fmt: skip


class NumericsRules:
    """Judges each logged step's per-format fractions and activation magnitudes; keeps nothing."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds

    def judge(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str], heads: Mapping[str, Heads]
    ) -> tuple[set[str], Candidates]:
        """The kinds this step judges (those whose scalars it has), and its candidates."""
        judged: set[str] = set()
        found: Candidates = {}
        amax = by_name(scalars, Root.ACTIVATION, Stat.AMAX)
        if amax:
            judged.add(MASSIVE)
            found.update(self._massive(step, scalars, amax))
        underflow = by_name(scalars, Root.GRADIENT, per_format(Lost.UNDERFLOW, "fp16"))
        if underflow:
            judged.add(FP16_UNDERFLOW)
            found.update(self._fp16(step, scalars, order, underflow))
        casting = by_name(scalars, Root.INPUT, per_format(Lost.UNDERFLOW, FORWARD))  # the Linears
        if casting:
            judged |= {FP8_UNDERFLOW, FP8_OVERFLOW}
            found.update(self._fp8(step, scalars, [m for m in order if m in casting]))
        return judged, found

    def _massive(self, step: int, scalars: Mapping[str, float], amax: Mapping[str, float]) -> Candidates:
        """Activations whose max |x| is above ``massive_activation`` and ``massive_ratio`` times their
        median |x|; not of a mostly-zero output (median 0: a ReLU's), whose ratio means nothing."""
        t = self.thresholds
        found: Candidates = {}
        for m, peak in amax.items():
            median = scalars.get(tag(Root.ACTIVATION, Stat.MEDIAN_ABS, m), math.nan)
            if not (median > 0 and peak > t.massive_activation and peak > t.massive_ratio * median):
                continue
            channel = scalars.get(tag(Root.ACTIVATION, Stat.AMAX_CHANNEL, m))
            where = "" if channel is None else f" in channel {channel:.0f}"
            ratio = peak / median
            _add(
                found,
                Finding(
                    MASSIVE, m, step, peak,
                    f"the output of {m} has a massive activation{where}: max |x| = {peak:.4g}, {ratio:.3g} times "
                    f"its median |x| ({median:.3g}); per-tensor fp8 scaling to it would flush the rest towards zero",
                ),
            )  # fmt: skip
        return found

    def _fp16(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str], underflow: Mapping[str, float]
    ) -> Candidates:
        """Modules whose output gradients lose at least ``fp16_gradient_underflow`` of their elements to
        zero in fp16 at the step's loss scale. Counted: the elements the cast makes zero that were
        not (``gradient/underflow_fp16``); zeros already there (a ReLU's, a zero-initialised
        branch's) are not losses. Where the cast makes none zero, as of a gradient computed in fp16
        under autocast (it has lost them already), estimated: the share the cast leaves at fp16's
        smallest subnormal (``gradient/floor_fp16``), the last step above zero, whose density is
        about that of what went below it while most of the gradient lies above; a gradient all
        zero, all of it, as exactly-zero evidence (a zero-initialised branch's waits ``zero_steps``)."""
        lost: dict[str, tuple[float, bool]] = {}  # the fraction, and whether it is estimated
        for m in order:
            if m not in underflow:
                continue
            floor = scalars.get(tag(Root.GRADIENT, per_format(Lost.FLOOR, "fp16"), m), 0.0)
            fraction, estimated = (underflow[m], False) if underflow[m] > 0 else (floor, True)
            if scalars.get(tag(Root.GRADIENT, Stat.AMAX, m)) == 0:
                fraction = 1.0
            if fraction >= self.thresholds.fp16_gradient_underflow:
                lost[m] = (fraction, estimated)
        if not lost:
            return {}
        worst = max(lost, key=lambda m: lost[m][0])
        scale = scalars.get(SCALE_TAG, 1.0)
        advice = _loss_scale_advice(scalars)
        found: Candidates = {}
        for m, (fraction, estimated) in lost.items():
            most = "" if m == worst else f" (the most: {worst}, {lost[worst][0]:.1%})"
            zeros = scalars.get(tag(Root.GRADIENT, Stat.ZERO_FRAC, m), math.nan)
            if zeros == 1:
                what = (
                    f"of the gradient w.r.t. the output of {m} is zero at loss scale {scale:g}: underflowed "
                    "in fp16 (or its branch passes no gradient yet)"
                )
            elif estimated:
                what = (
                    f"of the gradient w.r.t. the output of {m} is at fp16's smallest subnormal at loss scale "
                    f"{scale:g} and {zeros:.1%} of it is zero: computed in fp16, it has lost about as much below "
                    "that (estimated, not counted)"
                )
            else:
                what = f"of the gradient w.r.t. the output of {m} is lost to zero in fp16 at loss scale {scale:g}"
            finding = Finding(FP16_UNDERFLOW, m, step, fraction, f"{fraction:.1%} {what}{most}: {advice}")
            found[(FP16_UNDERFLOW, m)] = (finding, zeros == 1)
        return found

    def _fp8(self, step: int, scalars: Mapping[str, float], linears: Sequence[str]) -> Candidates:
        """Linears whose input, weight (e4m3) or output gradient (e5m2), scaled by ``max_F / amax``
        (per tensor; the input and weight per row with ``fp8_scaling="rowwise"``, and the output
        gradient then in e4m3 per row and per column), lose at least ``fp8_underflow`` to zero or
        more than ``fp8_overflow`` to NaN/Inf: the module named is the one that casts them."""
        t = self.thresholds
        found: Candidates = {}
        rowwise = bool(by_name(scalars, Root.GRADIENT, per_format(Lost.UNDERFLOW, FORWARD, Axis.ROWS)))
        casts = FP8_ROWWISE if rowwise else FP8
        for kind, lost, limit, what in (
            (FP8_UNDERFLOW, Lost.UNDERFLOW, t.fp8_underflow, "lost to zero"),
            (FP8_OVERFLOW, Lost.OVERFLOW, t.fp8_overflow, "NaN/Inf"),
        ):
            for m in linears:
                fraction, cast = max(
                    ((scalars.get(tag(c.root, c.stat(lost), m + c.suffix), 0.0), c) for c in casts),
                    key=lambda pair: pair[0],
                )
                crossed = fraction >= limit if kind == FP8_UNDERFLOW else fraction > limit
                if not crossed or not fraction > 0:
                    continue
                message = (
                    f"{fraction:.1%} of the {cast.tensor} of {m} is {what} in {cast.fmt} scaled to its max |x| "
                    f"({cast.scaled}), as fp8 training casts it in {m}: keep {m} in higher precision "
                    "(torchao's module_filter_fn), or find what sets its max (see massive_activation)"
                )
                _add(found, Finding(kind, m, step, fraction, message))
        return found


def _loss_scale_advice(scalars: Mapping[str, float]) -> str:
    """The loss scale that keeps every gradient the scaler multiplies finite in fp16: of the
    step's largest (unscaled) output or parameter gradient (a bias's gradient sums the output
    gradient over the batch, and can be far larger), with one power of two of headroom for
    gradients that grow over the next steps."""
    peaks = {
        name: v
        for root in (Root.GRADIENT, Root.PARAM_GRAD)
        for name, v in by_name(scalars, root, Stat.AMAX).items()
        if math.isfinite(v) and v > 0
    }
    if not peaks:
        return "raise the loss scale, or train in bf16"
    largest = max(peaks, key=peaks.__getitem__)
    power = math.floor(math.log2(FP16_MAX / peaks[largest])) - 1
    return (
        f"use a loss scale of 2^{power} = {2.0**power:.4g}, e.g. GradScaler(init_scale={2.0**power:.4g}) (half "
        f"of fp16's max {FP16_MAX:g} over the step's largest gradient, {peaks[largest]:.3g} of {largest}), "
        "or train in bf16"
    )


def _add(found: Candidates, finding: Finding) -> None:
    """A candidate of a module (its evidence is never exactly-zero evidence of an untrained layer)."""
    found[(finding.kind, finding.module)] = (finding, False)


def numerics_pictures(order: Sequence[str], every: Mapping[str, float]) -> dict[str, np.ndarray]:
    """The modules x formats pictures of a step's per-format scalars (all formats, written or
    not), one of the outputs and one of the output gradients: a row per watched module in
    forward order, a column per format, colour the fraction lost (underflow plus overflow) on
    a log scale, exact zeros black."""
    rows, table, held = _grid(order, every)
    lost = list(Lost)
    underflow, overflow = lost.index(Lost.UNDERFLOW), lost.index(Lost.OVERFLOW)
    out = {}
    for r, (root, name) in enumerate(PICTURES.items()):
        at = [i for i, m in enumerate(rows) if m in held[r]]
        if at:
            title = f"{name} lost to underflow + overflow, per module and format"
            fractions = table[r, at, :, underflow] + table[r, at, :, overflow]
            out[PICTURE_TAGS[root]] = pictures.fraction_grid([rows[i] for i in at], fractions, FORMATS, title)
    return out


def numerics_tensors(order: Sequence[str], every: Mapping[str, float]) -> dict[str, np.ndarray]:
    """The step's value table of the modules x formats pictures: float32 ``2 x modules x formats x 4``
    (outputs then output gradients; per format the underflow, overflow, subnormal and floor fractions; NaN
    where a module has no value), rows the watched modules with any, in forward order, and their
    escaped names."""
    rows, table, _ = _grid(order, every)
    if not rows:
        return {}
    return {NUMERICS_TABLE_TAG: table.astype(np.float32), rows_tag(NUMERICS_TABLE_TAG): names_tensor(rows)}


def _grid(order: Sequence[str], every: Mapping[str, float]) -> tuple[list[str], np.ndarray, list[set[str]]]:
    """The per-format fractions of a step as ``roots x modules x formats x Lost`` (float64, NaN
    where a module has none), rows the watched modules with a value of either root in forward
    order; and per root (:data:`PICTURES`) the modules that have its values."""
    indexed = Indexed(every)
    columns = {
        (r, f, lost): by_name(indexed, r, per_format(lost, f)) for r in PICTURES for f in FORMATS for lost in Lost
    }
    held = [set(columns[(r, FORMATS[0], Lost.UNDERFLOW)]) for r in PICTURES]
    rows = [m for m in order if any(m in h for h in held)]
    table = np.array(
        [
            [[[columns[(r, f, lost)].get(m, math.nan) for lost in Lost] for f in FORMATS] for m in rows]
            for r in PICTURES
        ],
        dtype=np.float64,
    ).reshape(len(PICTURES), len(rows), len(FORMATS), len(Lost))
    return rows, table, held
