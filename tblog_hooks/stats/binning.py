"""Every histogram of a logged step binned at once, on the device, in a fixed number of ops."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import numpy as np
import torch
from torch import Tensor

from .reductions import acc_dtype
from .sampling import IndexCache, device_index
from .tags import Root

if TYPE_CHECKING:
    from ..kernels import Kernels
    from ..topology.sharding import Split

#: Histogram buckets over ``[min, max]`` (TensorBoard's chart re-bins to ~30 anyway).
BINS = 32
#: Columns of a histogram row, followed by ``BINS`` counts: bucket ``b`` covers
#: ``start + 2 * half_span * [b, b + 1) / BINS`` (a half, so that the span of a range reaching
#: both ends of float32 does not overflow); min/max are the finite extremes of the row.
H_START, H_HALF_SPAN, H_MIN, H_MAX = range(4)
HIST_WIDTH = 4 + BINS


class Sample(NamedTuple):
    """A histogram sample of one tensor, with the tensor's exact extremes where known."""

    kind: str  # tag root: activation, input, gradient, param, param_grad
    name: str
    sample: Tensor
    numel: int  # elements of the tensor
    lo: Tensor | None
    hi: Tensor | None
    #: Elements each sampled one stands for, where only the device knows (``probes.histogram``):
    #: then ``numel`` is the sample's length and the counts are scaled on the device.
    weight: Tensor | None = None
    #: Of one rank's piece of a tensor split over ranks: the other pieces' ranks.
    split: Split | None = None
    #: Where ``lo`` and ``hi`` are one buffer (the fused kernels', ``kernels.outputs.Fused``): the
    #: min's offset in it, the max's the next; ``None``: ``lo`` and ``hi`` are 0-d.
    at: int | None = None

    def ends(self) -> tuple[Tensor | None, Tensor | None]:
        """The exact min and max, 0-d (``None`` where not known)."""
        if self.at is None or self.lo is None:
            return self.lo, self.hi
        return self.lo[self.at], self.lo[self.at + 1]


class RowInfo(NamedTuple):
    """What one histogram row describes: ``kind/name``, of a tensor of ``numel`` elements, from
    ``sampled`` of them."""

    kind: str
    name: str
    numel: int
    sampled: int


def bin_step(
    samples: list[Sample],
    device: torch.device,
    kinds: frozenset[str],
    cache: IndexCache,
    kernels: Kernels | None = None,
) -> tuple[Tensor, list[RowInfo]]:
    """Every histogram of the step binned at once (:func:`bin_rows`, flattened), and what each
    row is; the log10 histograms of the output gradients are derived here (the gradients' own
    rows are kept if ``kinds`` holds them)."""
    gradients = [h for h in samples if h.kind == Root.GRADIENT]
    logs_wanted = bool(gradients) and Root.GRADIENT_LOG10 in kinds
    rows = [h for h in samples if h.kind in kinds]  # (compiled hooks sample every scheduled kind)
    if not rows and not logs_wanted:
        return torch.empty(0), []
    values = _on(device, [h.sample for h in rows])
    if logs_wanted:
        # Zeros become -inf and, like NaN/Inf, stay out of the histogram.
        logs = torch.cat(_on(device, [h.sample for h in gradients])).float().abs_().log10_()
        values += list(logs.split([h.sample.numel() for h in gradients]))
        rows += [h._replace(kind=Root.GRADIENT_LOG10, lo=None, hi=None, at=None) for h in gradients]
    keys: dict[tuple[str, str], int] = {}
    index = [keys.setdefault((h.kind, h.name), len(keys)) for h in rows]
    lows, highs = _on(device, [h.lo for h in rows]), _on(device, [h.hi for h in rows])
    binned = bin_rows(values, lows, highs, index, cache, kernels, [h.at for h in rows])
    weights = [h.weight for h in rows]
    if any(w is not None for w in weights):  # probes' rows: scale their counts here
        one = binned.new_ones(())
        scale = torch.stack(_on(device, [one if w is None else w for w in weights])).to(binned.dtype)
        binned[:, HIST_WIDTH - BINS :] *= scale[:, None]
    return binned.reshape(-1), [RowInfo(h.kind, h.name, h.numel, h.sample.numel()) for h in rows]


T = TypeVar("T", Tensor, Tensor | None)


def _on(device: torch.device, tensors: list[T]) -> list[T]:
    """Results of a model spread over several devices, moved to one (a no-op on one device)."""
    return [t if t is None or t.device == device else t.to(device, non_blocking=True) for t in tensors]


def bin_rows(
    samples: list[Tensor],
    lows: Sequence[Tensor | None],
    highs: Sequence[Tensor | None],
    keys: Sequence[int],
    cache: IndexCache | None = None,
    kernels: Kernels | None = None,
    at: Sequence[int | None] = (),
) -> Tensor:
    """Histograms of all ``samples`` in a fixed number of ops, with no host-device copy.

    Rows sharing a key (calls of one module in a step) are binned over one range, so that the
    host can add them up. The range is ``[lows, highs]`` (exact extremes of the sampled tensor;
    where ``at`` gives an offset, the min at it and the max after it, in one buffer) where given
    and finite, else the sample's finite extremes. Returns float64 rows
    ``[start, half_span, min, max, counts...]``; non-finite elements are left out. Under
    ``torch.use_deterministic_algorithms(True)`` only deterministic kernels are used (see :func:`_counts`).
    Where ``kernels`` take the values, one Triton kernel positions and counts them (``kernels/fused.py``).
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
    lo_x, hi_x = _given_ends(lows, highs, at or [None] * count, dtype)
    # The exact extreme where finite (it is never beyond the sample's), else the sample's.
    lo = torch.minimum(torch.nan_to_num(lo_x, nan=inf, posinf=inf, neginf=inf), lo_s)
    hi = torch.maximum(torch.nan_to_num(hi_x, nan=-inf, posinf=-inf, neginf=-inf), hi_s)
    if len(set(keys)) < count:  # one range per key
        key_index = device_index(np.asarray(keys, dtype=np.int64), device)
        lo = torch.full_like(lo, inf).scatter_reduce_(0, key_index, lo, "amin").index_select(0, key_index)
        hi = torch.full_like(hi, -inf).scatter_reduce_(0, key_index, hi, "amax").index_select(0, key_index)
    # Halves: the span of a range reaching both ends of the dtype (-3e38..3e38 in float32) overflows.
    # Spans below the smallest normal number are widened to it (the edges follow), so that
    # BINS / half_span stays finite.
    half_span = (hi / 2 - lo / 2).clamp_min_(torch.finfo(dtype).tiny * BINS)
    wide = hi > lo  # false for constant rows and rows with no finite element
    start = torch.where(wide, lo, torch.where(lo < inf, lo - 0.5, 0.0))  # (lo: finite or +inf)
    half_span = torch.where(wide, half_span, 0.5)
    # Row r's bucket b becomes the number r * BINS + b + 0.5, so one count covers every row.
    # The scale stops just short of BINS, so the maximum lands in the last bucket; NaN and
    # +-inf fall outside the buckets.
    scale = BINS * (1 - 2**-16) / half_span
    counts = None if kernels is None else kernels.bucket_counts(values, rows, start / 2, scale, BINS)
    if counts is None:
        position = values.mul_(0.5).sub_(torch.index_select(start / 2, 0, rows)).mul_(scale.index_select(0, rows))
        counts = _counts(position.floor_().add_(offsets), count * BINS).view(count, BINS)
    head = torch.stack([start, half_span, lo, hi], dim=1)
    return torch.cat([head, counts.to(dtype)], dim=1).to(torch.float64)


def _given_ends(
    lows: Sequence[Tensor | None], highs: Sequence[Tensor | None], at: Sequence[int | None], dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The given extremes of each row as two vectors in ``dtype``, NaN where not given: 0-d ends
    stacked; where ends lie in buffers (``at``), each buffer taken once and the ends picked out
    by one index, so that the ops do not grow with the rows."""
    device = (lows[0] if lows[0] is not None else torch.empty(0)).device
    nan = torch.full((), math.nan, dtype=dtype, device=device)
    if all(a is None for a in at):
        return tuple(torch.stack([nan if t is None else t for t in ends]).to(dtype) for ends in (lows, highs))  # type: ignore[return-value]
    buffers: dict[int, int] = {}  # id of a buffer: its offset in the pool
    pool: list[Tensor] = []
    scalars: list[Tensor] = [nan]
    places: list[tuple[int, int]] = []  # per end: (0, offset in the pool's buffers) or (1, index in scalars)
    size = 0
    for ends, shift in ((lows, 0), (highs, 1)):
        for t, a in zip(ends, at):
            if t is None:
                places.append((1, 0))
            elif a is None:
                places.append((1, len(scalars)))
                scalars.append(t)
            else:
                if id(t) not in buffers:
                    buffers[id(t)] = size
                    pool.append(t)
                    size += t.numel()
                places.append((0, buffers[id(t)] + a + shift))
    index = np.array([offset if which == 0 else size + offset for which, offset in places], dtype=np.int64)
    joined = torch.cat([*pool, torch.stack(scalars).to(pool[0].dtype)])
    picked = joined.index_select(0, device_index(index, device)).to(dtype)
    return picked[: len(lows)], picked[len(lows) :]


def _counts(position: Tensor, buckets: int) -> Tensor:
    """How many ``position`` values (numbers ``k + 0.5``) fall into each bucket ``[k, k + 1)`` of
    ``[0, buckets)``, in ``position``'s dtype; NaN and +-inf are left out. ``histc`` has no
    deterministic CUDA kernel: under ``torch.use_deterministic_algorithms(True)`` (set by
    Lightning's ``deterministic=True`` and the HF Trainer's ``full_determinism``) it raises, so
    there the counts come from a sort and a binary search over the bucket edges, which are
    deterministic on every device and read nothing on the host."""
    if not torch.are_deterministic_algorithms_enabled():
        return torch.histc(position, bins=buckets, min=0, max=buckets)
    ordered = torch.nan_to_num(position, nan=-1.0, posinf=-1.0, neginf=-1.0).sort().values
    edges = torch.arange(buckets + 1, dtype=position.dtype, device=position.device)
    return torch.searchsorted(ordered, edges).diff().to(position.dtype)


def _row_index(lengths: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Per sampled element: its row, and ``row * BINS + 0.5`` in ``dtype`` (the same lengths
    recur every logged step)."""
    rows = np.repeat(np.arange(len(lengths)), lengths)
    offsets = (rows * BINS + 0.5).astype(np.float64 if dtype == torch.float64 else np.float32)
    return device_index(rows, device), device_index(offsets, device)
