"""The one device-to-host copy of a logged step, without stalling a CUDA stream.

On CUDA the packed results are copied with ``non_blocking=True`` into pinned memory and
an event is recorded; the host reads them once the event has completed, at a later
``step()`` or at ``close()``. On the CPU the copy is immediate.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


class Transfer:
    """One logged step's packed results on their way to the host."""

    def __init__(self, packed: Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if packed.device.type == "cuda":
            self._host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(packed.device))
        else:
            self._host = packed.to("cpu")

    def ready(self) -> bool:
        """True once the host copy holds the results (never waits)."""
        return self._event is None or self._event.query()

    def result(self) -> np.ndarray:
        """The results on the host, waiting for the copy if it is still in flight."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.numpy()
