"""Gradients as training sees them without the ``GradScaler``'s loss scale, and output gradients
as of the loss the data-parallel reduction averages, on the host.

The scale a logged step's backward used and whether the scaler skipped the step travel in the
step's transfer (``capture/recording.py``'s ``ScaleWatch``); here the step's gradient statistics that scale with the
loss are divided by it, and on a skipped step they are dropped (they would be garbage). Which
values those are the step's summary says, from the logger's recipe (``stats/recipe.py``).
"""

from __future__ import annotations

import dataclasses
import math

from ..stats.recipe import PARAM_GRADS, Source
from ..stats.tags import SCALE_TAG, SKIPPED_TAG
from .summary import Histogram, StepSummary


def unscale(summary: StepSummary, *, param_grads_scaled: bool) -> None:
    """Divide the step's gradient statistics that scale with the loss (``summary.scaled``) and
    its gradient histograms (``summary.scaled_histograms``) by the loss scale (shift log10
    histograms by its log10), or drop them if the scaler skipped the step (counts and fractions
    stay: the non-finite counts show where the overflow came from). Parameter gradients carry
    the scale only where ``param_grads_scaled`` (read before ``unscale_``), or on a skipped step.
    A no-op for steps without a scale."""
    if SCALE_TAG not in summary.scalars:
        return
    scale, skipped = summary.scalars[SCALE_TAG], bool(summary.scalars[SKIPPED_TAG])
    sources = {Source.OUTPUT_GRADIENT, *PARAM_GRADS} if param_grads_scaled or skipped else {Source.OUTPUT_GRADIENT}
    _divide(summary, sources, None if skipped else scale)


def divide_output_gradients(summary: StepSummary, divisor: float) -> None:
    """Divide the step's output-gradient statistics that scale with the loss, and their
    histograms, by what the data-parallel reduction divides the parameter gradients by
    (``distributed.gradient_divisor``): each rank's output gradients are of its own loss, the
    parameter gradients the optimizer applies of their average. Counts and fractions stay those
    of the values the rank held (as under a loss scale)."""
    if divisor != 1.0:
        _divide(summary, {Source.OUTPUT_GRADIENT}, divisor)


def _divide(summary: StepSummary, sources: set[Source], by: float | None) -> None:
    """The scalars of ``sources`` that scale with the loss, and their histograms, divided by
    ``by`` (``None``: dropped)."""
    for key in [k for k, source in summary.scaled.items() if source in sources and k in summary.scalars]:
        if by is None:
            del summary.scalars[key]
        else:
            summary.scalars[key] /= by
    for key, (source, log10) in summary.scaled_histograms.items():
        if source not in sources or key not in summary.histograms:
            continue
        if by is None:
            del summary.histograms[key]
        elif log10:
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
