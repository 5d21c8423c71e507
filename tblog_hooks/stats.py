"""Device-side statistics: the values of one record, a histogram sample, and every histogram
of a step binned at once.

Nothing here reads a value back to the host. Each function is written for few ops (each op is
a kernel launch on a GPU): reductions return 0-d tensors that ``records.pack`` stacks once per
step, and work that does not depend on the tensor's values (sample indices) is cached.
"""

from __future__ import annotations

import functools
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

#: Histogram buckets over ``[min, max]`` (TensorBoard's chart re-bins to ~30 anyway).
BINS = 32
#: Histograms of tensors with more elements than this are built from a fixed pseudo-random
#: sample of this many elements (the same indices for every tensor of a size, step after step).
#: Jittered rather than strided: a stride aliases with the layout (every k-th element of an NCHW
#: map can lie in one column). Statistics and the histogram's total are exact, and so are its
#: min and max for activations and output gradients.
SAMPLE_CAP = 1 << 13

#: Columns of a histogram row, followed by ``BINS`` counts: bucket ``b`` covers
#: ``start + 2 * half_span * [b, b + 1) / BINS`` (a half, so that the span of a range reaching
#: both ends of float32 does not overflow); min/max are the finite extremes of the row.
H_START, H_HALF_SPAN, H_MIN, H_MAX = range(4)
HIST_WIDTH = 4 + BINS

#: Floating dtypes the reductions support (float8 types have no mean, aminmax or promotion).
FLOAT_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


def loggable(x: object) -> bool:
    """Dense, non-empty, real floating-point tensors; everything else is skipped, not an error."""
    return (
        isinstance(x, Tensor)
        and x.layout == torch.strided
        and not x.is_nested
        and x.dtype in FLOAT_DTYPES
        and not x.is_meta
        and x.numel() > 0
    )


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation type: float32, or float64 for float64 tensors (no ``torch.promote_types``:
    it is dispatched like an op)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


#: Up to this many elements, float32 counts ones exactly (every partial sum is an integer it holds).
_EXACT_FLOAT32_COUNT = 1 << 24


def finite(x: Tensor) -> Tensor:
    """Count of finite elements (a float, on the tensor's device; exact): ``1 - 0 * x`` is 1
    where ``x`` is finite and NaN where not, and ``nansum`` adds up the ones. Two ops, and four
    times faster on a CPU than ``count_nonzero(x * 0)``, whose counting loop branches."""
    dtype = torch.float32 if x.numel() <= _EXACT_FLOAT32_COUNT else torch.float64
    return torch.rsub(x, 1, alpha=0).nansum(dtype=dtype)


def nonfinite(x: Tensor) -> Tensor:
    """Count of NaN/Inf elements (a float, on the tensor's device). Output gradients record
    this rather than :func:`finite`: under ``torch.compile`` their records (``probes.summary``)
    do not know their element count on the host, which would take the finite count from it."""
    return x.numel() - finite(x)


def norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """L2 norms of many tensors in one op per dtype class, accumulated in float32 or wider
    (a float16 norm overflows at 65504)."""
    out: list[Tensor | None] = [None] * len(tensors)
    for wide in (False, True):
        index = [i for i, t in enumerate(tensors) if (t.dtype == torch.float64) == wide]
        if index:
            dtype = torch.float64 if wide else torch.float32
            for i, norm in zip(index, torch._foreach_norm([tensors[i] for i in index], 2, dtype=dtype)):
                out[i] = norm
    return out  # type: ignore[return-value]


def sparse_values(g: Tensor) -> tuple[Tensor, Tensor]:
    """The values of a sparse COO tensor (a sparse ``.grad``) with those of repeated indices added
    up, as the dense tensor holds them: for the norm, one row per stored entry, sums first,
    then zero rows; for the histogram, the same with NaN rows (left out of histograms). As
    ``coalesce()``, but without its host sync (how many indices are distinct is known only on
    the device). An accumulated sparse ``.grad`` repeats every index looked up more than once."""
    values = g._values()
    if g.is_coalesced() or values.shape[0] < 2:
        return values, values
    indices = g._indices()
    key = indices[0]
    for dim in range(1, g.sparse_dim()):  # one integer per index, ordered as the indices are
        key = key * g.shape[dim] + indices[dim]
    key, order = torch.sort(key)
    first = torch.ones_like(key, dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]
    slot = torch.cumsum(first, 0) - 1  # where each sorted entry's sum goes
    summed = torch.zeros_like(values).index_add_(0, slot, values.index_select(0, order))
    used = (torch.arange(key.numel(), device=key.device) <= slot[-1]).view(-1, *[1] * (values.dim() - 1))
    return summed, torch.where(used, summed, math.nan)


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


def sample(x: Tensor, cache: IndexCache | None = None) -> Tensor:
    """A flat copy of ``x``'s elements for its histogram: all of them up to :data:`SAMPLE_CAP`,
    else one element at a pseudo-random place in each of ``SAMPLE_CAP`` equal stretches of it
    (jittered: no stride to alias with the layout, and every stretch represented; from an
    integer hash, so the same for every tensor of a size, no generator state). A copy, so later
    in-place ops on ``x`` cannot change it."""
    n = x.numel()
    if not torch.compiler.is_compiling():
        make = functools.partial(_sample_index, n, x.device)
        return torch.take(x, make() if cache is None else cache.get(("sample", n, x.device), make))
    # Traced into the graph: a cache would be one more guard, and one more graph.
    if n <= SAMPLE_CAP:
        return torch.take(x, torch.arange(n, device=x.device))
    jitter = _hash(torch.arange(1, SAMPLE_CAP + 1, device=x.device)).double() / 2**32
    return torch.take(x, ((torch.arange(SAMPLE_CAP, device=x.device) + jitter) * (n / SAMPLE_CAP)).long())


def _sample_index(n: int, device: torch.device) -> Tensor:
    """The indices :func:`sample` takes, made on the host (no device op)."""
    if n <= SAMPLE_CAP:
        return _device_index(np.arange(n), device)
    jitter = _hash(np.arange(1, SAMPLE_CAP + 1, dtype=np.int64)) / 2**32
    return _device_index(((np.arange(SAMPLE_CAP) + jitter) * (n / SAMPLE_CAP)).astype(np.int64), device)


H = TypeVar("H", Tensor, np.ndarray)
T = TypeVar("T")


def _hash(h: H) -> H:
    """A 32-bit integer hash ("lowbias32"-style) of int64 values, for NumPy arrays and tensors alike."""
    for _ in range(2):
        h = ((h >> 16) ^ h) * 0x45D9F3B & 0xFFFFFFFF
    return (h >> 16) ^ h  # type: ignore[no-any-return]  # NumPy operators are untyped


def histograms(
    samples: list[Tensor],
    lows: Sequence[Tensor | None],
    highs: Sequence[Tensor | None],
    keys: Sequence[int],
    cache: IndexCache | None = None,
) -> Tensor:
    """Histograms of all ``samples`` in a fixed number of ops, with no host-device copy.

    Rows sharing a key (calls of one module in a step) are binned over one range, so that the
    host can add them up. The range is ``[lows, highs]`` (exact extremes of the sampled tensor)
    where given and finite, else the sample's finite extremes. Returns float64 rows
    ``[start, half_span, min, max, counts...]``; non-finite elements are left out.
    """
    device = samples[0].device
    count = len(samples)
    values = torch.cat(samples)
    dtype = acc_dtype(values.dtype)
    values = values.to(dtype)
    lengths = tuple(s.numel() for s in samples)
    make = functools.partial(_row_index, lengths, device, dtype)
    rows, offsets = make() if cache is None else cache.get(("rows", lengths, device, dtype), make)
    inf = math.inf
    lo_s = torch.full((count,), inf, dtype=dtype, device=device)
    lo_s.scatter_reduce_(0, rows, torch.nan_to_num(values, nan=inf, posinf=inf, neginf=inf), "amin")
    hi_s = torch.full((count,), -inf, dtype=dtype, device=device)
    hi_s.scatter_reduce_(0, rows, torch.nan_to_num(values, nan=-inf, posinf=-inf, neginf=-inf), "amax")
    missing = lo_s.new_full((), math.nan)
    lo_x = torch.stack([missing if t is None else t for t in lows]).to(dtype)
    hi_x = torch.stack([missing if t is None else t for t in highs]).to(dtype)
    # The exact extreme where finite (it is never beyond the sample's), else the sample's.
    lo = torch.minimum(torch.nan_to_num(lo_x, nan=inf, posinf=inf, neginf=inf), lo_s)
    hi = torch.maximum(torch.nan_to_num(hi_x, nan=-inf, posinf=-inf, neginf=-inf), hi_s)
    if len(set(keys)) < count:  # one range per key
        key_index = _device_index(np.asarray(keys, dtype=np.int64), device)
        lo = torch.full_like(lo, inf).scatter_reduce_(0, key_index, lo, "amin").index_select(0, key_index)
        hi = torch.full_like(hi, -inf).scatter_reduce_(0, key_index, hi, "amax").index_select(0, key_index)
    # Halves: the span of a range reaching both ends of the dtype (-3e38..3e38 in float32) overflows.
    # Spans below the smallest normal number are widened to it (the edges follow), so that
    # BINS / half_span stays finite.
    half_span = (hi / 2 - lo / 2).clamp_min_(torch.finfo(dtype).tiny * BINS)
    wide = hi > lo  # false for constant rows and rows with no finite element
    start = torch.where(wide, lo, torch.where(torch.isfinite(lo), lo - 0.5, 0.0))
    half_span = torch.where(wide, half_span, 0.5)
    # Row r's bucket b becomes the number r * BINS + b + 0.5, so one histc counts every row.
    # The scale stops just short of BINS, so the maximum lands in the last bucket; NaN and
    # +-inf fall outside histc's range.
    scale = torch.index_select(BINS * (1 - 2**-16) / half_span, 0, rows)
    position = values.mul_(0.5).sub_(torch.index_select(start / 2, 0, rows)).mul_(scale)
    position = position.floor_().add_(offsets)
    counts = torch.histc(position, bins=count * BINS, min=0, max=count * BINS).view(count, BINS)
    head = torch.stack([start, half_span, lo, hi], dim=1)
    return torch.cat([head, counts.to(dtype)], dim=1).to(torch.float64)


def _row_index(lengths: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per sampled element: its row, and ``row * BINS + 0.5`` in ``dtype`` (the same lengths
    recur every logged step)."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    offsets = (rows * BINS + 0.5).astype(np.float64 if dtype == torch.float64 else np.float32)
    return _device_index(rows, device), _device_index(offsets, device)


def _device_index(values: np.ndarray, device: torch.device) -> Tensor:
    """A host array as a tensor on ``device``: no op on the CPU; on CUDA a copy from pinned
    memory that blocks neither the host nor the stream."""
    host = torch.from_numpy(values)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)
