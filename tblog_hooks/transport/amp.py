"""Gradients under ``GradScaler``: the loss scale and the skip flag read on the device.

During backward every gradient is multiplied by the scaler's loss scale. The scale in use
and whether the scaler skipped the step (inf/nan found) are read from the scaler's own
device tensors and recorded as ``amp/loss_scale`` and ``amp/skipped_step``, so they travel
in the logged step's one transfer; ``output/scaling.py`` applies them on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .._compat import found_inf, initial_scale, loss_scale, unscaled
from ..stats.tags import SCALE_TAG, SKIPPED_TAG

if TYPE_CHECKING:
    from ..capture.step import StepBuffer


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


def unscaled_by(scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The loss scale ``scaler`` divided ``optimizer``'s gradients by (``GradScaler.unscale_``, which
    its ``step()`` calls before the optimizer's), on its device; ``None`` where it did not."""
    if scaler is None or not scaler.is_enabled() or not unscaled(scaler, optimizer):
        return None
    return loss_scale(scaler)
