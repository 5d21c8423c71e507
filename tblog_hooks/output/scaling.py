"""Gradients as training sees them without the ``GradScaler``'s loss scale, and output gradients
as of the loss the data-parallel reduction averages, on the host.

The scale a logged step's backward used and whether the scaler skipped the step travel in the
step's transfer (``transport/amp.py``); here the step's gradient statistics that scale with the
loss are divided by it, and on a skipped step they are dropped (they would be garbage).
"""

from __future__ import annotations

import dataclasses
import math

from ..stats.kinds import GRADIENT, NUMERIC_KINDS, PARAM_GRAD, Kind
from ..stats.tags import SCALE_TAG, SKIPPED_TAG, Root, tag
from .summary import Histogram, StepSummary


def unscale(summary: StepSummary, *, param_grads_scaled: bool) -> None:
    """Divide the step's gradient statistics that scale with the loss (as their measures declare,
    ``stats/kinds.py``) and its gradient histograms by the loss scale (shift log10 histograms by
    its log10), or drop them if the scaler skipped the step (counts and fractions stay: the
    non-finite counts show where the overflow came from). A no-op for steps without a scale."""
    if SCALE_TAG not in summary.scalars:
        return
    scale, skipped = summary.scalars[SCALE_TAG], bool(summary.scalars[SKIPPED_TAG])
    raw = (GRADIENT, PARAM_GRAD) if param_grads_scaled or skipped else (GRADIENT,)
    _divide(summary, raw, None if skipped else scale)


def divide_output_gradients(summary: StepSummary, divisor: float) -> None:
    """Divide the step's output-gradient statistics that scale with the loss, and their
    histograms, by what the data-parallel reduction divides the parameter gradients by
    (``distributed.gradient_divisor``): each rank's output gradients are of its own loss, the
    parameter gradients the optimizer applies of their average. Counts and fractions stay those
    of the values the rank held (as under a loss scale)."""
    if divisor != 1.0:
        _divide(summary, (GRADIENT,), divisor)


def _divide(summary: StepSummary, raw: tuple[Kind, ...], by: float | None) -> None:
    """The scalars of ``raw`` (and their numerics kinds) that scale with the loss, and their
    histograms, divided by ``by`` (``None``: dropped)."""
    kinds = (*raw, *(NUMERIC_KINDS[kind] for kind in raw))
    scaled = tuple(tag(kind.name, stat, "") for kind in kinds for stat in kind.scaled_stats())
    totals = {tag(kind.name, stat) for kind in kinds for stat in kind.scaled_stats()}
    for key in [k for k in summary.scalars if k.startswith(scaled) or k in totals]:
        if by is None:
            del summary.scalars[key]
        else:
            summary.scalars[key] /= by
    prefixes = tuple(tag(kind.name, "") for kind in kinds)
    log10 = tag(Root.GRADIENT_LOG10, "")
    for key in [k for k in summary.histograms if k.startswith((*prefixes, log10))]:
        if by is None:
            del summary.histograms[key]
        elif key.startswith(log10):
            summary.histograms[key] = _affine(summary.histograms[key], 1.0, -math.log10(by))
        else:
            summary.histograms[key] = _affine(summary.histograms[key], 1.0 / by, 0.0)


def _affine(h: Histogram, a: float, b: float) -> Histogram:
    """The histogram of ``a * x + b`` (``a > 0``) from that of ``x``."""
    return dataclasses.replace(
        h,
        min=a * h.min + b,
        max=a * h.max + b,
        sum=a * h.sum + b * h.num,
        sum_squares=a * a * h.sum_squares + 2 * a * b * h.sum + b * b * h.num,
        limits=[a * limit + b for limit in h.limits],
    )
