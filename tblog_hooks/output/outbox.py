"""Logged steps on their way to TensorBoard: each one's copy to the host, then, in step order, its
summary (AMP loss scale undone, output gradients as of the averaged loss), handed to what writes
it (with its diagnostics)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor

from ..stats.numerics import Written
from ..stats.packing import StepLayout
from ..transport.transfer import Transfer
from .scaling import divide_output_gradients, unscale
from .summarize import summarize
from .summary import StepSummary


class WriteError(Exception):
    """Writing logged step ``step`` failed (disk full, permission lost, a broken writer)."""

    def __init__(self, step: int, error: Exception) -> None:
        super().__init__(step, error)
        self.step, self.error = step, error


class _Pending(NamedTuple):
    step: int
    transfer: Transfer
    layout: StepLayout
    divisor: float  # of its output gradients (see scaling.divide_output_gradients)


class Outbox:
    """Packed logged steps, written once their transfer to the host has completed."""

    def __init__(
        self,
        write: Callable[[StepSummary], None],
        *,
        param_grads_scaled: bool,
        numerics: Written | None = None,
        gradient_divisor: Callable[[], float] = lambda: 1.0,
    ) -> None:
        """``gradient_divisor``: what the data-parallel reduction divides parameter gradients by
        now (``scaling.divide_output_gradients``)."""
        self._write = write  # a step's summary to its diagnostics and the event files
        self._param_grads_scaled = param_grads_scaled  # (see scaling.unscale)
        self._gradient_divisor = gradient_divisor
        self._numerics = numerics  # the formats whose scalars are written
        self._pending: deque[_Pending] = deque()

    def send(self, step: int, packed: Tensor, layout: StepLayout) -> None:
        """Start the transfer of one logged step's packed results."""
        self._pending.append(_Pending(step, Transfer(packed), layout, self._gradient_divisor()))

    def write(self, *, wait: bool) -> None:
        """Write finished transfers in step order; with ``wait``, all of them. Raises
        :class:`WriteError` for the first step that cannot be written (it is dropped)."""
        while self._pending and (wait or self._pending[0].transfer.ready()):
            step, transfer, layout, divisor = self._pending.popleft()
            try:
                summary = summarize(step, transfer.result(), layout)
                unscale(summary, param_grads_scaled=self._param_grads_scaled)
                divide_output_gradients(summary, divisor)
                if self._numerics is not None:
                    summary.numerics = self._numerics.written(summary.scalars, summary.formats, summary.casts)
                self._write(summary)
            except Exception as error:
                raise WriteError(step, error) from error

    def drop(self) -> None:
        """Forget every step not written yet (logging was switched off)."""
        self._pending.clear()
