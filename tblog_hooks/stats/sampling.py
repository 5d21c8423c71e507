"""Histogram samples: a bounded, deterministic subset of a tensor's elements, taken on its device.

Index tensors do not depend on the tensor's values, so they are made on the host once per size
and kept in an :class:`IndexCache` (the same sizes recur every logged step).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

#: Histograms of tensors with more elements than this are built from a fixed pseudo-random
#: sample of this many elements (the same indices for every tensor of a size, step after step).
#: Jittered rather than strided: a stride aliases with the layout (every k-th element of an NCHW
#: map can lie in one column). Statistics and the histogram's total are exact, and so are its
#: min and max for activations and output gradients.
SAMPLE_CAP = 1 << 13


class IndexCache:
    """Index tensors made on the host once per size (the same sizes recur every logged step, and
    making one on the host costs no device op); one per logger, emptied when it closes, at most
    ``size`` of them (variable sequence lengths make new sizes)."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._made: OrderedDict[tuple[object, ...], Any] = OrderedDict()
        self._lock = threading.Lock()  # hooks run on several threads

    def get(self, key: tuple[object, ...], make: Callable[[], T]) -> T:
        with self._lock:
            made = self._made.get(key)
            if made is not None:
                self._made.move_to_end(key)
                return made  # type: ignore[no-any-return]
        made = make()
        with self._lock:
            self._made[key] = made
            while len(self._made) > self._size:
                self._made.popitem(last=False)
        return made

    def clear(self) -> None:
        with self._lock:
            self._made.clear()


def sample(x: Tensor, cache: IndexCache) -> Tensor:
    """A flat copy of ``x``'s elements for its histogram: all of them up to :data:`SAMPLE_CAP`,
    else one element at a pseudo-random place in each of ``SAMPLE_CAP`` equal stretches of it
    (jittered: no stride to alias with the layout, and every stretch represented; from an
    integer hash, so the same for every tensor of a size, no generator state). A copy, so later
    in-place ops on ``x`` cannot change it. The indices are made on the host, once per size."""
    n = x.numel()
    return torch.take(x, cache.get(("sample", n, x.device), functools.partial(_sample_index, n, x.device)))


def traced_sample(x: Tensor) -> Tensor:
    """:func:`sample` with the same indices made by device ops, for code that ``torch.compile``
    traces: a host-made index would be a constant of the graph, and its cache one more guard."""
    n = x.numel()
    if n <= SAMPLE_CAP:
        return torch.take(x, torch.arange(n, device=x.device))
    jitter = _hash(torch.arange(1, SAMPLE_CAP + 1, device=x.device)).double() / 2**32
    return torch.take(x, ((torch.arange(SAMPLE_CAP, device=x.device) + jitter) * (n / SAMPLE_CAP)).long())


def _sample_index(n: int, device: torch.device) -> Tensor:
    """The indices :func:`sample` takes, made on the host (no device op)."""
    if n <= SAMPLE_CAP:
        return device_index(np.arange(n), device)
    jitter = _hash(np.arange(1, SAMPLE_CAP + 1, dtype=np.int64)) / 2**32
    return device_index(((np.arange(SAMPLE_CAP) + jitter) * (n / SAMPLE_CAP)).astype(np.int64), device)


def device_index(values: np.ndarray, device: torch.device) -> Tensor:
    """A host array as a tensor on ``device``: no op on the CPU; on CUDA a copy from pinned
    memory that blocks neither the host nor the stream."""
    host = torch.from_numpy(values)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


H = TypeVar("H", Tensor, np.ndarray)
T = TypeVar("T")


def _hash(h: H) -> H:
    """A 32-bit integer hash ("lowbias32"-style) of int64 values, for NumPy arrays and tensors alike."""
    for _ in range(2):
        h = ((h >> 16) ^ h) * 0x45D9F3B & 0xFFFFFFFF
    return (h >> 16) ^ h  # type: ignore[no-any-return]  # NumPy operators are untyped
