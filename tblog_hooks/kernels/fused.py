"""The statistics of one watched tensor, and the step's histogram counts, as Triton kernels.

A tensor's statistics take two launches: :func:`_partials` reads the tensor once, each program
reducing one tile to its partial state (count, sum, centred sum of squares, sum of squares in
float64 as the torch path's norm, extremes, amax, the powers relative to the tile's amax, the
zero / finite / NaN counts, the unscaled formats' boundary counts, per unit the peak and amax);
:func:`_combine` reduces the partials in a fixed order (Chan et al.'s pairwise update for the
centred sum of squares, the powers rescaled to the largest amax as ``numerics.pool_powers``
does, every count in one pass), so the result is the same on every run: no float atomics.
With ``numerics=`` a third launch, :func:`_scaled_counts`, counts the float8 formats' boundaries
after scaling by the per-tensor scale the second one found (a first-pass result); its integer
atomics add exactly, in any order. Where the tensor's histogram is taken, the second launch also
copies its histogram sample (``sampling.sample``'s elements, their positions worked out in the
kernel); :func:`_gather_samples` copies the samples of many tensors (parameters and their
gradients) in one launch, and :func:`_buckets` counts a step's histogram buckets.

The kernels are registered as custom ops (``torch.library``) with fake implementations, so
compiled hooks trace them as one node each. Import this module only where Triton is importable
(``tblog_hooks.kernels``); under ``TRITON_INTERPRET=1``, set before it is imported, the kernels run
on CPU tensors in Triton's interpreter (how the test suite proves them).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from ..stats import numerics
from ..stats.reductions import acc_dtype
from ..stats.sampling import SAMPLE_CAP, device_index
from . import outputs
from .outputs import COUNTS, PER_UNIT, SCALARS, TOTALS, Fused

_UNSCALED = tuple(f for f in numerics.FORMATS.values() if not f.scaled)
_SCALED = tuple(f for f in numerics.FORMATS.values() if f.scaled)
#: Whether the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when this was imported).
INTERPRETED = bool(triton.knobs.runtime.interpret)
#: Elements a program of the first pass reduces, partials a combining program takes at once, and
#: units a combining program takes. The interpreter runs each program as Python (milliseconds a
#: reduction), so there a program takes up to a million elements; the tests set smaller blocks to
#: prove the combining.
BLOCK, CHUNK, UNIT_CHUNK = (1 << 20, 1 << 14, 1 << 12) if INTERPRETED else (4096, 1024, 32)
#: Units a first-pass tile spans at most (the rest of the tile is rows: elements of the same units).
TILE_UNITS = 1 << 12 if INTERPRETED else 64
#: Histogram sample elements a program copies at a time.
SAMPLE_BLOCK = SAMPLE_CAP if INTERPRETED else 1024
_CAP = tl.constexpr(SAMPLE_CAP)
#: Integer types of each element size: samples are copied as bits (NaN payloads and float8 alike).
_BITS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}


def _slots(names: tuple[str, ...], *which: str) -> tuple[tl.constexpr, ...]:
    """Where each of ``which`` is in a buffer laid out as ``names``, as the kernels index it."""
    return tuple(tl.constexpr(names.index(name)) for name in which)


# Every buffer's slots, by name (module-level constexprs, which the kernels read as constants).
# The outputs (``outputs.py``): the scalars, and the counts, each format's side by side from
# ``_UNSCALED_AT`` and ``_SCALED_AT``, in the order of its ``names`` (``numerics.UNSCALED_COUNTS``).
_MEAN, _CENTRED_NORM, _MIN, _MAX, _NORM, _AMAX, _REF, _SUM2, _SUM4 = _slots(SCALARS, *SCALARS)
_NONZERO, _FINITE, _NONFINITE, _UNSCALED_AT, _SCALED_AT = _slots(
    COUNTS, *TOTALS, _UNSCALED[0].names[0], _SCALED[0].names[0]
)
_ZERO, _KEPT, _SMALL, _LEAST = _slots(numerics.UNSCALED_COUNTS, *numerics.UNSCALED_COUNTS)
_N_UNSCALED, _N_SCALED = tl.constexpr(len(_UNSCALED)), tl.constexpr(len(_SCALED))
_PEAK, _UNIT_AMAX = _slots(PER_UNIT, *PER_UNIT)
_N_PER_UNIT = tl.constexpr(len(PER_UNIT))
# The one float64 buffer a call fills (``outputs.slots``): the scalars, the counts from
# ``_COUNTS_AT``, the per-unit rows from ``_UNITS_AT``.
_COUNTS_AT, _UNITS_AT = tl.constexpr(len(SCALARS)), tl.constexpr(len(SCALARS) + len(COUNTS))
_PER_UNSCALED, _PER_SCALED = tl.constexpr(len(numerics.UNSCALED_COUNTS)), tl.constexpr(len(numerics.SCALED_COUNTS))
# A first-pass partial's float fields, stored as float64: each a value of the accumulation dtype
# but the sum of squares, summed in float64 as the torch path's norm is (in float32 it overflows
# once the norm passes 1.8e19 and drops elements below 1e-19); and its int32 counts (the NaN
# count, then the unscaled formats' counts as in the outputs).
_PARTIAL = ("n", "sum", "m2", "sq", "min", "max", "amax", "ref", "s2", "s4")
_P_N, _P_SUM, _P_M2, _P_SQ, _P_MIN, _P_MAX, _P_AMAX, _P_REF, _P_S2, _P_S4 = _slots(_PARTIAL, *_PARTIAL)
_PARTIAL_COUNTS = ("nan", "nonzero", "finite", *(n for f in _UNSCALED for n in f.names))
_C_NAN, _C_NONZERO, _C_FINITE, _C_UNSCALED = _slots(_PARTIAL_COUNTS, "nan", "nonzero", "finite", _UNSCALED[0].names[0])
_NF, _NC = tl.constexpr(len(_PARTIAL)), tl.constexpr(len(_PARTIAL_COUNTS))
# A partial's counts as lanes of a vector (a power of two), added up at once; the scaled formats'
# counts as lanes too.
_COUNT_LANES = tl.constexpr(1 << (len(_PARTIAL_COUNTS) - 1).bit_length())
_SCALED_LANES = tl.constexpr(1 << (len(_SCALED) * len(numerics.SCALED_COUNTS) - 1).bit_length())
# The boundaries the kernels compare with (:func:`_constants`), each named as the count that
# compares with it: the amax floor, every format's bounds, then each scaled format's max.
_BOUNDS = ("amax_floor", *numerics.COUNTED, *(f"max_{f.name}" for f in _SCALED))
_K_FLOOR, _K_UNSCALED, _K_SCALED, _K_MAXIMA = _slots(
    _BOUNDS, "amax_floor", _UNSCALED[0].names[0], _SCALED[0].names[0], f"max_{_SCALED[0].name}"
)


@functools.cache
def _constants(device: torch.device, dtype: torch.dtype) -> Tensor:
    """The boundaries the kernels compare with (``_BOUNDS``), in the accumulation dtype, as
    ``numerics.measure`` compares: the amax floor; per format, for each count, the bound it
    compares with (flushed to zero, the largest magnitude that stays finite, and unscaled the
    smallest normal and the bound below which a cast gives at most the least subnormal); per
    scaled format its max."""
    np_dtype = np.float64 if dtype == torch.float64 else np.float32

    def finite(fmt: numerics.Format) -> float:
        """A tie that rounds up to inf/NaN moved one step down: every test of it is ``<=``."""
        bound, tie_stays = fmt.finite
        return float(np_dtype(bound) if tie_stays else np.nextafter(np_dtype(bound), np_dtype(0)))

    values: dict[str, float] = {"amax_floor": numerics.AMAX_FLOOR}
    for fmt in numerics.FORMATS.values():
        values.update(zip(fmt.names, (fmt.flushed, finite(fmt), fmt.normal, fmt.least)))  # (as UNSCALED_COUNTS)
        if fmt.scaled:
            values[f"max_{fmt.name}"] = fmt.max
    return torch.tensor(np.array([values[name] for name in _BOUNDS], dtype=np_dtype), device=device)


@triton.jit
def _chan(n1, m1, q1, n2, m2, q2):  # type: ignore[no-untyped-def]
    """Two (count, mean, centred sum of squares) states as one (Chan et al.); an empty side is
    the other state as it is (no inf - inf from a padding lane)."""
    n = n1 + n2
    w = n2 / tl.where(n > 0, n, 1.0)
    d = m2 - m1
    m = m1 + d * w
    q = q1 + q2 + d * d * n1 * w
    m = tl.where(n1 == 0, m2, tl.where(n2 == 0, m1, m))
    q = tl.where(n1 == 0, q2, tl.where(n2 == 0, q1, q))
    return n, m, q


@triton.jit
def _reciprocal(x, ACC: tl.constexpr):  # type: ignore[no-untyped-def]
    """``1 / x`` correctly rounded, as ``torch.reciprocal`` (float32 division is approximate on a GPU)."""
    if ACC == tl.float64:  # noqa: SIM300 (a constexpr compared at compile time)
        return 1.0 / x
    else:
        return tl.math.div_rn(1.0, x)


@triton.jit
def _nan_max(x, ok, nan, fill, axis: tl.constexpr):  # type: ignore[no-untyped-def]
    """``amax`` along ``axis`` that is NaN where a NaN was (``ok``: valid, not NaN)."""
    top = tl.max(tl.where(ok, x, fill), axis)
    return tl.where(tl.max(nan.to(tl.int32), axis) > 0, float("nan"), top)


@triton.jit
def _partials(  # type: ignore[no-untyped-def]
    x_ptr, part_ptr, count_ptr, unit_ptr, const_ptr, R, U, INNER, PU, PR,
    BR: tl.constexpr, BU: tl.constexpr, ACC: tl.constexpr, UNITS: tl.constexpr, NUMERICS: tl.constexpr,
):  # fmt: skip
    """One tile's partial state: ``BR`` rest indices (the tensor seen as ``outer x U x INNER``,
    rest = outer and inner together) by ``BU`` units."""
    pid = tl.program_id(0)
    pr = (pid // PU).to(tl.int64)
    pu = pid % PU
    r = pr * BR + tl.arange(0, BR)[:, None]
    u = pu * BU + tl.arange(0, BU)[None, :]
    valid = (r < R) & (u < U)
    x = tl.load(x_ptr + (r // INNER) * U * INNER + u * INNER + r % INNER, mask=valid, other=0.0).to(ACC)
    nan = valid & (x != x)
    ok = valid & (x == x)
    n = tl.sum(valid.to(ACC))
    xs = tl.where(valid, x, 0.0)
    total = tl.sum(xs)
    mean = total / n
    d = tl.where(valid, x - mean, 0.0)
    a = tl.abs(xs)
    amax = tl.max(tl.where(ok, a, 0.0))
    ref = tl.maximum(amax, tl.load(const_ptr + _K_FLOOR))
    q = a * _reciprocal(ref, ACC)
    q = q * q
    base = part_ptr + pid * _NF
    tl.store(base + _P_N, n)
    tl.store(base + _P_SUM, total)
    tl.store(base + _P_M2, tl.sum(d * d))
    wide = xs.to(tl.float64)
    tl.store(base + _P_SQ, tl.sum(wide * wide))
    tl.store(base + _P_MIN, tl.min(tl.where(ok, x, float("inf"))))
    tl.store(base + _P_MAX, tl.max(tl.where(ok, x, -float("inf"))))
    tl.store(base + _P_AMAX, amax)
    tl.store(base + _P_REF, ref)
    tl.store(base + _P_S2, tl.sum(q))
    tl.store(base + _P_S4, tl.sum(q * q))
    counts = count_ptr + pid * _NC
    tl.store(counts + _C_NAN, tl.sum(nan.to(tl.int32)))
    tl.store(counts + _C_NONZERO, tl.sum((valid & (x != 0)).to(tl.int32)))
    tl.store(counts + _C_FINITE, tl.sum((valid & (x - x == 0)).to(tl.int32)))
    if NUMERICS:
        for i in tl.static_range(_N_UNSCALED):
            bounds = const_ptr + _K_UNSCALED + _PER_UNSCALED * i
            own = counts + _C_UNSCALED + _PER_UNSCALED * i
            tl.store(own + _ZERO, tl.sum((valid & (a <= tl.load(bounds + _ZERO))).to(tl.int32)))
            tl.store(own + _KEPT, tl.sum((valid & (a <= tl.load(bounds + _KEPT))).to(tl.int32)))
            tl.store(own + _SMALL, tl.sum((valid & (a < tl.load(bounds + _SMALL))).to(tl.int32)))
            tl.store(own + _LEAST, tl.sum((valid & (a < tl.load(bounds + _LEAST))).to(tl.int32)))
    if UNITS:
        cols = pu * BU + tl.arange(0, BU)
        tl.store(unit_ptr + (_PEAK * PR + pr) * U + cols, _nan_max(x, ok, nan, -float("inf"), 0), mask=cols < U)
        tl.store(unit_ptr + (_UNIT_AMAX * PR + pr) * U + cols, _nan_max(a, ok, nan, 0.0, 0), mask=cols < U)


@triton.jit
def _combine(  # type: ignore[no-untyped-def]
    part_ptr, count_ptr, unit_ptr, out_ptr, x_ptr, sample_ptr, P, PR, U, NUMEL, K,
    C: tl.constexpr, CN: tl.constexpr, CR: tl.constexpr, CU: tl.constexpr, ACC: tl.constexpr,
    UNITS: tl.constexpr, NUMERICS: tl.constexpr, SAMPLE: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    """The partials as the tensor's values, in a fixed order: program 0 the scalars (``C``
    partials at a time) and counts (``CN`` partials at a time), every program ``CU`` units'
    peaks and amax (``CR`` rows of partials at a time); with ``SAMPLE``, the programs share the
    copy of the ``K`` elements of the histogram sample of ``x`` (:func:`_copy_sample`)."""
    pid = tl.program_id(0)
    if SAMPLE:
        _copy_sample(x_ptr, sample_ptr, NUMEL, K, pid, tl.num_programs(0), SB)
    if UNITS:
        cols = pid * CU + tl.arange(0, CU)[None, :]
        for which in tl.static_range(_N_PER_UNIT):  # (their partials and outputs laid out as PER_UNIT)
            best = tl.full([CR, CU], -float("inf"), ACC)
            seen_nan = tl.zeros([CR, CU], tl.int32)
            for start in range(0, PR, CR):
                rows = start + tl.arange(0, CR)[:, None]
                v = tl.load(unit_ptr + (which * PR + rows) * U + cols, mask=(rows < PR) & (cols < U), other=0.0)
                seen_nan = tl.maximum(seen_nan, (v != v).to(tl.int32))
                best = tl.maximum(best, tl.where((rows < PR) & (v == v), v, -float("inf")))
            peak = tl.where(tl.max(seen_nan, 0) > 0, float("nan"), tl.max(best, 0))
            flat = pid * CU + tl.arange(0, CU)
            tl.store(out_ptr + _UNITS_AT + which * U + flat, peak.to(tl.float64), mask=flat < U)
    if pid == 0:
        lanes = tl.arange(0, C)
        n = tl.zeros([C], ACC)
        mean = tl.zeros([C], ACC)
        m2 = tl.zeros([C], ACC)
        total = tl.zeros([C], tl.float64)
        sq = tl.zeros([C], tl.float64)
        lo = tl.full([C], float("inf"), ACC)
        hi = tl.full([C], -float("inf"), ACC)
        amax = tl.zeros([C], ACC)
        ref = tl.zeros([C], ACC)
        for start in range(0, P, C):
            at = start + lanes
            m = at < P
            row = part_ptr + at * _NF
            pn = tl.load(row + _P_N, mask=m, other=0.0).to(ACC)
            psum = tl.load(row + _P_SUM, mask=m, other=0.0)
            pm2 = tl.load(row + _P_M2, mask=m, other=0.0).to(ACC)
            n, mean, m2 = _chan(n, mean, m2, pn, psum.to(ACC) / tl.where(pn > 0, pn, 1.0), pm2)
            total += psum
            sq += tl.load(row + _P_SQ, mask=m, other=0.0)
            lo = tl.minimum(lo, tl.load(row + _P_MIN, mask=m, other=float("inf")).to(ACC))
            hi = tl.maximum(hi, tl.load(row + _P_MAX, mask=m, other=-float("inf")).to(ACC))
            amax = tl.maximum(amax, tl.load(row + _P_AMAX, mask=m, other=0.0).to(ACC))
            ref = tl.maximum(ref, tl.load(row + _P_REF, mask=m, other=0.0).to(ACC))
        # The lanes' states as one (the pairwise update of many groups at once, about the overall mean).
        centre = tl.sum(n * mean) / tl.sum(n)
        m2_all = tl.sum(m2) + tl.sum(tl.where(n > 0, n * (mean - centre) * (mean - centre), 0.0))
        top = tl.max(ref)
        s2 = tl.zeros([C], ACC)
        s4 = tl.zeros([C], ACC)
        for start in range(0, P, C):  # the powers rescaled to the largest tile amax
            at = start + lanes
            m = at < P
            row = part_ptr + at * _NF
            ratio = tl.load(row + _P_REF, mask=m, other=0.0).to(ACC) / top
            ratio = ratio * ratio
            s2 += tl.where(m, tl.load(row + _P_S2, mask=m, other=0.0).to(ACC) * ratio, 0.0)
            s4 += tl.where(m, tl.load(row + _P_S4, mask=m, other=0.0).to(ACC) * (ratio * ratio), 0.0)
        counts = _count_totals(count_ptr, P, CN)
        any_nan = _lane(counts, _C_NAN) > 0
        nan = float("nan")
        tl.store(out_ptr + _MEAN, tl.sum(total) / NUMEL)
        tl.store(out_ptr + _CENTRED_NORM, tl.sqrt(m2_all.to(tl.float64)))
        tl.store(out_ptr + _MIN, tl.where(any_nan, nan, tl.min(lo).to(tl.float64)))
        tl.store(out_ptr + _MAX, tl.where(any_nan, nan, tl.max(hi).to(tl.float64)))
        tl.store(out_ptr + _NORM, tl.sqrt(tl.sum(sq)))
        tl.store(out_ptr + _AMAX, tl.where(any_nan, nan, tl.max(amax).to(tl.float64)))
        tl.store(out_ptr + _REF, tl.where(any_nan, nan, top.to(tl.float64)))
        tl.store(out_ptr + _SUM2, tl.sum(s2).to(tl.float64))
        tl.store(out_ptr + _SUM4, tl.sum(s4).to(tl.float64))
        _store_counts(counts, out_ptr + _COUNTS_AT, NUMEL, NUMERICS)


@triton.jit
def _count_totals(count_ptr, P, CN: tl.constexpr):  # type: ignore[no-untyped-def]
    """Every partial's counts added up in int64, ``CN`` partials at a time: a vector of
    ``_COUNT_LANES`` laid out as ``_PARTIAL_COUNTS`` (zeros after them)."""
    rows = tl.arange(0, CN)[:, None]
    lanes = tl.arange(0, _COUNT_LANES)[None, :]
    totals = tl.zeros([_COUNT_LANES], tl.int64)
    for start in range(0, P, CN):
        at = start + rows
        counts = tl.load(count_ptr + at * _NC + lanes, mask=(at < P) & (lanes < _NC), other=0)
        totals += tl.sum(counts.to(tl.int64), 0)
    return totals


@triton.jit
def _lane(v, i):  # type: ignore[no-untyped-def]
    """Element ``i`` of the vector ``v``."""
    return tl.sum(tl.where(tl.arange(0, v.shape[0]) == i, v, 0))


@triton.jit
def _store_counts(counts, cnt_ptr, NUMEL, NUMERICS: tl.constexpr):  # type: ignore[no-untyped-def]
    """The tensor's counts from the partials' (:func:`_count_totals`), into float64 (exact below
    2**53): the non-finite count is the elements not finite; the unscaled formats' are 0 without
    ``NUMERICS``, the scaled formats' start at 0 (:func:`_scaled_counts` adds to them)."""
    tl.store(cnt_ptr + _NONZERO, _lane(counts, _C_NONZERO).to(tl.float64))
    finite = _lane(counts, _C_FINITE)
    tl.store(cnt_ptr + _FINITE, finite.to(tl.float64))
    tl.store(cnt_ptr + _NONFINITE, (NUMEL - finite).to(tl.float64))
    k = tl.arange(0, _COUNT_LANES) - _C_UNSCALED  # (each lane's place among the unscaled formats' counts)
    unscaled = (k >= 0) & (k < _PER_UNSCALED * _N_UNSCALED)
    if NUMERICS:
        tl.store(cnt_ptr + _UNSCALED_AT + k, counts.to(tl.float64), mask=unscaled)
    else:
        tl.store(cnt_ptr + _UNSCALED_AT + k, tl.zeros([_COUNT_LANES], tl.float64), mask=unscaled)
    k = tl.arange(0, _SCALED_LANES)
    tl.store(cnt_ptr + _SCALED_AT + k, tl.zeros([_SCALED_LANES], tl.float64), mask=k < _PER_SCALED * _N_SCALED)


@triton.jit
def _scaled_counts(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, const_ptr, NUMEL, BLOCK: tl.constexpr, ACC: tl.constexpr,
):  # fmt: skip
    """Per scaled format, the elements a cast after per-tensor scaling by ``max / ref`` makes 0
    and keeps finite (``numerics.measure``'s comparisons, in its order of rounding); the counts
    are added as float64 integers, exact in any order below 2**53."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = at < NUMEL
    a = tl.abs(tl.load(x_ptr + at, mask=m, other=0.0).to(ACC))
    scale = _reciprocal(tl.load(out_ptr + _REF).to(ACC), ACC)
    for i in tl.static_range(_N_SCALED):
        seen = a * (scale * tl.load(const_ptr + _K_MAXIMA + i))
        bounds = const_ptr + _K_SCALED + _PER_SCALED * i
        own = out_ptr + _COUNTS_AT + _SCALED_AT + _PER_SCALED * i
        tl.atomic_add(own + _ZERO, tl.sum((m & (seen <= tl.load(bounds + _ZERO))).to(tl.int64)).to(tl.float64))
        tl.atomic_add(own + _KEPT, tl.sum((m & (seen <= tl.load(bounds + _KEPT))).to(tl.int64)).to(tl.float64))


@triton.jit
def _sample_position(i, NUMEL, K):  # type: ignore[no-untyped-def]
    """The flat positions in a tensor of ``NUMEL`` elements of its ``K``-element histogram
    sample's elements ``i`` (``sampling._sample_index``, computed as it is: the same float64
    operations, so the same positions): all elements in order up to ``_CAP``, else one at a
    hashed place in each of ``_CAP`` equal stretches."""
    h = (i + 1).to(tl.int64)
    low = tl.full((), 4294967295, tl.int64)  # (2**32 - 1: a 32-bit hash in int64)
    for _ in tl.static_range(2):
        h = (((h >> 16) ^ h) * 0x45D9F3B) & low
    h = (h >> 16) ^ h
    jitter = h.to(tl.float64) / 4294967296.0
    stretch = NUMEL.to(tl.float64) / _CAP
    return tl.where(NUMEL > K, ((i.to(tl.float64) + jitter) * stretch).to(tl.int64), i.to(tl.int64))


@triton.jit
def _copy_sample(src, dst, NUMEL, K, first, stride, SB: tl.constexpr):  # type: ignore[no-untyped-def]
    """Elements ``first * SB ...`` (every ``stride * SB``) of the ``K``-element histogram sample of
    ``src`` (``NUMEL`` elements, contiguous) copied to ``dst``, as they are."""
    for start in range(first * SB, K, stride * SB):
        i = start + tl.arange(0, SB)
        m = i < K
        tl.store(dst + i, tl.load(src + _sample_position(i, NUMEL, K), mask=m), mask=m)


@triton.jit
def _gather_samples(table_ptr, T, BITS: tl.constexpr, SB: tl.constexpr):  # type: ignore[no-untyped-def]
    """The histogram samples of ``T`` tensors of one element size, each copied as bits: program
    ``(t, j)`` copies part ``j`` of tensor ``t``'s, read from the table's columns (the tensor's
    address, its sample's, its element count, the sample's length)."""
    t = tl.program_id(0)
    kind = tl.pointer_type(BITS)
    src = tl.load(table_ptr + t).to(kind, bitcast=True)
    dst = tl.load(table_ptr + T + t).to(kind, bitcast=True)
    _copy_sample(src, dst, tl.load(table_ptr + 2 * T + t), tl.load(table_ptr + 3 * T + t),
                 tl.program_id(1), tl.num_programs(1), SB)  # fmt: skip


@triton.jit
def _buckets(  # type: ignore[no-untyped-def]
    v_ptr, row_ptr, half_start_ptr, scale_ptr, count_ptr, N, BINS: tl.constexpr, BLOCK: tl.constexpr
):
    """Each value's bucket in its row, ``floor((v / 2 - start / 2) * scale)`` rounded as
    ``binning.bin_rows`` rounds it, counted where it is one of the row's ``BINS`` (NaN and
    +-inf are not); integer atomics add exactly in any order."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = at < N
    v = tl.load(v_ptr + at, mask=m, other=0.0)
    row = tl.load(row_ptr + at, mask=m, other=0)
    half_start = tl.load(half_start_ptr + row, mask=m, other=0.0)
    position = tl.floor((v * 0.5 - half_start) * tl.load(scale_ptr + row, mask=m, other=0.0))
    inside = m & (position >= 0) & (position < BINS)
    bucket = row * BINS + tl.where(inside, position, 0.0).to(tl.int64)
    tl.atomic_add(count_ptr + bucket, tl.full([BLOCK], 1, tl.int32), mask=inside)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _layout(x: Tensor, units: int, per_unit: bool) -> tuple[int, int, int]:
    """``x`` as ``outer x U x inner`` around its units dim: (rest = outer * inner, U, inner);
    without units, one unit."""
    if not (per_unit and x.dim() >= 2):
        return x.numel(), 1, 1
    dim = units % x.dim()
    inner = 1
    for size in x.shape[dim + 1 :]:
        inner *= size
    return x.numel() // x.shape[dim], x.shape[dim], inner


def _width(x: Tensor, units: int, per_unit: bool) -> int:
    """Units of ``x`` whose per-unit values a call gives (0: none)."""
    return x.shape[units % x.dim()] if per_unit and x.dim() >= 2 else 0


def _sampled(x: Tensor, sample: bool) -> int:
    """Elements of ``x``'s histogram sample (0: none taken)."""
    return min(x.numel(), SAMPLE_CAP) if sample else 0


@torch.library.custom_op("tblog_hooks::tensor_statistics", mutates_args=())
def tensor_statistics(x: Tensor, units: int, per_unit: bool, numerics: bool, sample: bool) -> tuple[Tensor, Tensor]:
    """``x``'s values in one float64 buffer laid out as ``outputs.slots``: its ``outputs.SCALARS``,
    ``outputs.COUNTS`` and, with ``per_unit`` and 2+ dims, its ``outputs.PER_UNIT`` values along
    dim ``units`` (a row each, a value per unit); and with ``sample`` its histogram sample
    (``sampling.sample``'s elements, in ``x``'s dtype; else empty). ``x`` is contiguous; without
    ``numerics`` the per-format counts are 0."""
    acc = acc_dtype(x.dtype)
    rest, width, inner = _layout(x, units, per_unit)
    has_units = per_unit and x.dim() >= 2
    tile_units = min(_pow2(width), TILE_UNITS)
    tile_rows = min(BLOCK // tile_units, _pow2(rest))
    pu, pr = triton.cdiv(width, tile_units), triton.cdiv(rest, tile_rows)
    parts = x.new_empty((pr * pu, len(_PARTIAL)), dtype=torch.float64)
    part_counts = x.new_empty((pr * pu, len(_PARTIAL_COUNTS)), dtype=torch.int32)
    unit_parts = x.new_empty((len(PER_UNIT), pr, width) if has_units else (1,), dtype=acc)
    out = x.new_empty(outputs.size(_width(x, units, per_unit)), dtype=torch.float64)
    sampled = x.new_empty(_sampled(x, sample))
    constants = _constants(x.device, acc)
    kind = tl.float64 if acc == torch.float64 else tl.float32
    common = {"ACC": kind, "UNITS": has_units, "NUMERICS": numerics}
    _partials[(pr * pu,)](x, parts, part_counts, unit_parts, constants, rest, width, inner, pu, pr,
                          BR=tile_rows, BU=tile_units, **common)  # fmt: skip
    unit_chunk = min(_pow2(width), UNIT_CHUNK)
    grid = (triton.cdiv(width, unit_chunk) if has_units else 1,)
    chunk, rows = min(_pow2(pr * pu), CHUNK), min(_pow2(pr), CHUNK // unit_chunk)
    count_rows = min(_pow2(pr * pu), max(CHUNK // _COUNT_LANES.value, 1))
    _combine[grid](parts, part_counts, unit_parts, out, x, sampled, pr * pu, pr, width, x.numel(), sampled.numel(),
                   C=chunk, CN=count_rows, CR=rows, CU=unit_chunk, SAMPLE=sample, SB=SAMPLE_BLOCK,
                   **common)  # fmt: skip
    if numerics:
        block = min(BLOCK, _pow2(x.numel()))
        _scaled_counts[(triton.cdiv(x.numel(), block),)](x, out, constants, x.numel(), BLOCK=block, ACC=kind)
    return out, sampled


@tensor_statistics.register_fake
def _(x: Tensor, units: int, per_unit: bool, numerics: bool, sample: bool) -> tuple[Tensor, Tensor]:
    return x.new_empty(outputs.size(_width(x, units, per_unit)), dtype=torch.float64), x.new_empty(_sampled(x, sample))


@torch.library.custom_op("tblog_hooks::histogram_samples", mutates_args=())
def histogram_samples(tensors: list[Tensor]) -> list[Tensor]:
    """The histogram sample of each of ``tensors`` (contiguous, of one device; ``sampling.sample``'s
    elements), copied with one launch per element size."""
    out = [t.new_empty(_sampled(t, True)) for t in tensors]
    sizes: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        sizes.setdefault(t.element_size(), []).append(i)
    for size, at in sizes.items():
        columns = [[t.data_ptr(), o.data_ptr(), t.numel(), o.numel()] for t, o in ((tensors[i], out[i]) for i in at)]
        table = device_index(np.array(columns, dtype=np.int64).T.reshape(-1), tensors[at[0]].device)
        grid = (len(at), triton.cdiv(SAMPLE_CAP, SAMPLE_BLOCK))
        _gather_samples[grid](table, len(at), BITS=_BITS[size], SB=SAMPLE_BLOCK)
    return out


@histogram_samples.register_fake
def _(tensors: list[Tensor]) -> list[Tensor]:
    return [t.new_empty(_sampled(t, True)) for t in tensors]


@torch.library.custom_op("tblog_hooks::bucket_counts", mutates_args=())
def bucket_counts(values: Tensor, rows: Tensor, half_start: Tensor, scale: Tensor, bins: int) -> Tensor:
    """How many of ``values`` (contiguous, each of row ``rows[i]``) fall into each of the ``bins``
    buckets of their row (``binning.bin_rows``' positions): int32, ``len(half_start) x bins``."""
    counts = torch.zeros((half_start.numel(), bins), dtype=torch.int32, device=values.device)
    if values.numel():
        block = min(BLOCK, _pow2(values.numel()))
        _buckets[(triton.cdiv(values.numel(), block),)](
            values, rows, half_start, scale, counts, values.numel(), BINS=bins, BLOCK=block
        )
    return counts


@bucket_counts.register_fake
def _(values: Tensor, rows: Tensor, half_start: Tensor, scale: Tensor, bins: int) -> Tensor:
    return values.new_empty((half_start.shape[0], bins), dtype=torch.int32)


def statistics(x: Tensor, units: int, *, per_unit: bool, numerics: bool, sample: bool = False) -> Fused:
    """The values of ``x`` the kernels give, by the names the torch reductions give them
    (``outputs.OUTPUTS``; with ``per_unit`` only, ``outputs.PER_UNIT``), in one buffer; with
    ``sample``, its histogram sample too."""
    if not x.is_contiguous():
        x = x.contiguous()
    width = _width(x, units, per_unit) if per_unit else None
    buffer, sampled = tensor_statistics(x, units, per_unit, numerics, sample)
    return Fused(buffer, outputs.slots(width), sampled if sample else None)
