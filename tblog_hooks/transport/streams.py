"""The CUDA streams a logged step's hooks ran on, joined before the step is packed.

Hooks record on the stream current where they run: training inside ``with torch.cuda.stream(s):``
puts the forward, the backward and the optimizer, and so the records, on ``s``. The step ends
(weights read, records packed) at ``step()``, on the stream current there. So that stream first
waits for each other stream the hooks ran on, and every recorded tensor is marked as used by it
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
        self._packing: dict[torch.device, torch.cuda.Stream] = {}  # per device: the stream that waited

    def note(self, t: Tensor) -> None:
        """A hook recorded ``t``: the stream current for its device (CUDA only) is one the step ran on."""
        if t.is_cuda:
            self._seen.add(torch.cuda.current_stream(t.device))

    def wait(self) -> None:
        """The step's training is over: the current streams wait for the other streams noted (the
        weights read next, and the packing, come after the training's last kernels)."""
        seen, self._seen = self._seen, set()
        for stream in seen:
            current = torch.cuda.current_stream(stream.device)
            if stream != current:
                current.wait_stream(stream)
                self._packing[current.device] = current

    def keep(self, tensors: Iterable[Tensor]) -> None:
        """Before ``tensors`` (the step's records) are packed: keep the memory of those made on
        another stream from it until the current stream's queued work is done."""
        packing, self._packing = self._packing, {}
        if packing:
            for t in tensors:
                used = packing.get(t.device)
                if used is not None:
                    t.record_stream(used)
