"""Gradients under ``GradScaler``: unscaled on the host, and skipped steps reported as such.

During backward every gradient is multiplied by the scaler's loss scale. The scale in use
and whether the scaler skipped the step (inf/nan found) are read from the scaler's own
device tensors and recorded as ``amp/loss_scale`` and ``amp/skipped_step`` (so they travel
in the logged step's one transfer), then applied in :func:`unscale`: norms and histogram
edges are divided by the scale; on a skipped step gradient norms and histograms are
dropped (they would be garbage).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._compat import found_inf, initial_scale, loss_scale
from ..output.summarize import Histogram, StepSummary
from ..stats.tags import Root, Stat, tag

if TYPE_CHECKING:
    from ..capture.step import StepBuffer

SCALE_TAG, SKIPPED_TAG = tag(Root.AMP, Stat.LOSS_SCALE), tag(Root.AMP, Stat.SKIPPED_STEP)


class ScaleWatch:
    """Reads one enabled ``GradScaler``'s scale around a logged step, on its device, never on the host."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler
        self._before: Tensor | None = None

    def begin(self) -> None:
        """At the start of a logged step: the scale its backward passes will use."""
        scale = loss_scale(self.scaler)
        self._before = None if scale is None else scale.detach().clone()

    def finish(self, buffer: StepBuffer) -> None:
        """Record the scale used by the step's backward, and whether the scaler skipped the step."""
        scale = loss_scale(self.scaler)
        if scale is None:  # the scaler was not used in this step
            return
        found = found_inf(self.scaler)
        if found:  # step() ran but update() has not: the current scale is the one backward used
            used, skipped = scale, torch.stack([f.to(scale.device) for f in found]).sum() > 0
        else:  # update() ran: it lowers the scale exactly when it skipped the step
            before = self._before if self._before is not None else torch.full_like(scale, initial_scale(self.scaler))
            used, skipped = before, scale < before
        buffer.record_scalar(SCALE_TAG, used)
        buffer.record_scalar(SKIPPED_TAG, skipped)


def grad_scale(optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The loss scale still in ``.grad`` when ``GradScaler.step`` calls an optimizer that unscales
    inside its own ``step()`` (``fused=True`` Adam, AdamW, SGD): the scaler hands it over as
    ``optimizer.grad_scale`` for the length of the step (``None`` once ``unscale_`` ran)."""
    scale = getattr(optimizer, "grad_scale", None)
    return scale if isinstance(scale, Tensor) else None


def unscale(summary: StepSummary, *, param_grads_scaled: bool) -> None:
    """Divide the step's gradient norms and histograms by the loss scale (shift log10 histograms
    by its log10), or drop them if the scaler skipped the step (non-finite counts stay: they
    show where the overflow came from). A no-op for steps without a scale."""
    if SCALE_TAG not in summary.scalars:
        return
    scale, skipped = summary.scalars[SCALE_TAG], bool(summary.scalars[SKIPPED_TAG])
    kinds = (Root.GRADIENT, Root.PARAM_GRAD) if param_grads_scaled or skipped else (Root.GRADIENT,)
    prefixes = tuple(tag(kind, "") for kind in kinds)
    nonfinite = tag(Root.GRADIENT, Stat.NONFINITE, "")
    for key in [k for k in summary.scalars if k.startswith(prefixes) and not k.startswith(nonfinite)]:
        if skipped:
            del summary.scalars[key]
        else:
            summary.scalars[key] /= scale
    log10 = tag(Root.GRADIENT_LOG10, "")
    for key in [k for k in summary.histograms if k.startswith((*prefixes, log10))]:
        if skipped:
            del summary.histograms[key]
        elif key.startswith(log10):
            summary.histograms[key] = _affine(summary.histograms[key], 1.0, -math.log10(scale))
        else:
            summary.histograms[key] = _affine(summary.histograms[key], 1.0 / scale, 0.0)


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
