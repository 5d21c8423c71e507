"""The CUDA streams a logged step's hooks ran on, joined before the step is packed.

Hooks record on the stream current where they run: training inside ``with torch.cuda.stream(s):``
puts the forward, the backward and the optimizer, and so the records, on ``s``. The step is
packed at ``step()``, on the stream current there. So packing first makes that stream wait for
each other stream the hooks ran on, and marks every recorded tensor as used by it
(``Tensor.record_stream``): dropped once the packing kernels are queued, the tensors' blocks
would otherwise go back to ``s``'s pool at once, and ``s``'s next kernels could write them before
the packing kernels read them (the step would log the next one's values).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


class Streams:
    """The streams one logged step recorded on (sets only grow while hooks run: safe from the
    backward's threads)."""

    def __init__(self) -> None:
        self._seen: set[torch.cuda.Stream] = set()

    def note(self, t: Tensor) -> None:
        """A hook recorded ``t``: the stream current for its device (CUDA only) is one the step ran on."""
        if t.is_cuda:
            self._seen.add(torch.cuda.current_stream(t.device))

    def join(self, tensors: Iterable[Tensor]) -> None:
        """Before ``tensors`` (the step's records) are packed on the current streams: wait for the
        other streams noted, keep the tensors' memory from them until the packing is done, and
        forget the streams."""
        seen, self._seen = self._seen, set()
        packing: dict[torch.device, torch.cuda.Stream] = {}
        for stream in seen:
            current = torch.cuda.current_stream(stream.device)
            if stream != current:
                current.wait_stream(stream)
                packing[current.device] = current
        if packing:
            for t in tensors:
                used = packing.get(t.device)
                if used is not None:
                    t.record_stream(used)
