"""Device-side statistics: one row per tensor, and all histograms of a step in one batch.

Nothing here reads a value back to the host; rows and histogram counts stay on the
tensor's device until the logged step packs them for its single transfer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

#: Histogram buckets per tensor (TensorBoard re-bins to ~30 for display).
BINS = 64
#: Histograms of tensors with more elements than this are built from a deterministic
#: strided subsample of this many elements; the scalar statistics are always exact.
SAMPLE_CAP = 1 << 11

# Columns of an activation's float row (float32 on the device):
# mean, L2 norm of (x - mean), min, max; and of its count row (int64): nonzero,
# non-finite and dead-channel counts. Centring before squaring keeps the standard
# deviation accurate when |mean| >> std, in one extra pass.
MEAN, CENTRED_NORM, MIN, MAX = range(4)
NONZERO, NONFINITE, DEAD = range(3)

# Columns of a histogram row (float64), followed by BINS counts.
H_LO, H_SPAN, H_MIN, H_MAX = range(4)
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
        and x.device.type != "meta"
        and x.numel() > 0
    )


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def activation_row(x: Tensor) -> tuple[Tensor, Tensor]:
    """Exact statistics of ``x``: a float row (mean, centred norm, min, max) accumulated in
    float32 or wider, and an int64 row (nonzero, non-finite, dead channels: dim 1 never > 0)."""
    x = x.detach()
    dtype = _acc_dtype(x)
    mean = x.mean(dtype=dtype)
    # 16-bit inputs are centred in float32: a 16-bit x - mean would round each term.
    centred = x - mean if x.dtype == dtype else x.to(dtype).sub_(mean)
    norm = torch.linalg.vector_norm(centred, dtype=dtype)
    lo, hi = torch.aminmax(x)
    if x.dim() >= 2:
        # Trailing dims first: reducing over (0, 2, 3) at once is several times slower on CPU.
        peak = x.amax(dim=tuple(range(2, x.dim()))) if x.dim() > 2 else x
        dead = (peak.amax(dim=0) <= 0).sum()
    else:
        dead = torch.zeros((), dtype=torch.int64, device=x.device)
    return torch.stack([mean, norm, lo, hi]), torch.stack([torch.count_nonzero(x), nonfinite(x), dead])


def gradient_row(g: Tensor) -> tuple[Tensor, Tensor]:
    """L2 norm (float32 or wider) and non-finite count of a gradient."""
    g = g.detach()
    return torch.linalg.vector_norm(g, dtype=_acc_dtype(g)), nonfinite(g)


def nonfinite(x: Tensor) -> Tensor:
    """Count of NaN/Inf elements (int64, on the tensor's device)."""
    return torch.count_nonzero(x * 0)  # inf * 0 and nan * 0 are nan, finite * 0 is 0


def channels(x: Tensor) -> int:
    """How many channels the dead-unit count is out of (dim 1; 0 for tensors below 2-D)."""
    return x.shape[1] if x.dim() >= 2 else 0


def sample(x: Tensor, cap: int = SAMPLE_CAP) -> Tensor:
    """A flat copy of ``x`` (float32 or wider) for the histogram: every element up to
    ``cap``, else every k-th element in memory order. A copy, so later in-place ops
    on ``x`` cannot change it."""
    x = x.detach()
    dtype = _acc_dtype(x)
    n = x.numel()
    if n <= cap:
        return x.reshape(-1).to(dtype, copy=True)
    stride = -(-n // cap)
    dense = x.is_contiguous() or any(
        x.dim() == rank and x.is_contiguous(memory_format=fmt)
        for rank, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d))
    )
    picked = x.as_strided((-(-n // stride),), (stride,)) if dense else x.reshape(-1)[::stride]
    return picked.to(dtype, copy=True)


def histograms(samples: Sequence[Tensor]) -> Tensor:
    """Histograms of all ``samples`` in a handful of ops, with no host-device copy.

    Returns float64 rows ``[lo, span, min, max, counts...]``: bucket ``b`` covers
    ``lo + span * (b, b + 1] / BINS``; ``min``/``max`` are the finite extremes (inf/-inf
    when a sample has no finite element). Non-finite elements are left out.
    """
    dtype = functools.reduce(torch.promote_types, (s.dtype for s in samples))
    padded = pad_sequence([s.to(dtype) for s in samples], batch_first=True, padding_value=math.nan)
    count = padded.shape[0]
    inf = math.inf
    lo = torch.nan_to_num(padded, nan=inf, posinf=inf, neginf=inf).amin(dim=1, keepdim=True)
    hi = torch.nan_to_num(padded, nan=-inf, posinf=-inf, neginf=-inf).amax(dim=1, keepdim=True)
    # Halves: the span of a range reaching both ends of the dtype (-3e38..3e38 in float32) overflows.
    half_span = hi / 2 - lo / 2
    wide = half_span > 0  # false for constant samples and for samples with no finite element
    start = torch.where(wide, lo, torch.where(torch.isfinite(lo), lo - 0.5, 0.0))
    half_span = torch.where(wide, half_span, 0.5)
    # Row r's bucket b becomes the number r * BINS + b + 0.5, so that one histc over all rows
    # counts every row at once. The scale stops just short of BINS, so the maximum lands in
    # the last bucket; NaN and +-inf fall outside histc's range and are not counted.
    # Divide, then scale: BINS / half_span overflows for tiny (subnormal) spans.
    offset = torch.arange(count, device=padded.device, dtype=dtype).mul_(BINS).add_(0.5).unsqueeze(1)
    position = padded.mul(0.5).sub_(start / 2).div_(half_span).mul_(BINS * (1 - 2**-16)).floor_().add_(offset)
    counts = torch.histc(position, bins=count * BINS, min=0, max=count * BINS).view(count, BINS)
    head = torch.cat([start, half_span, lo, hi], dim=1).to(torch.float64)
    head[:, H_SPAN] *= 2
    return torch.cat([head, counts.to(torch.float64)], dim=1)
