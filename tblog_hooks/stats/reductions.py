"""Device-side reductions: the statistics of one tensor, counts, norms.

Nothing here reads a value back to the host. Each function is written for few ops (each op is
a kernel launch on a GPU): reductions return 0-d tensors that ``packing.pack`` stacks once per
step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from .._compat import foreach_norm, sparse_parts

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


def elements(x: Tensor) -> Tensor:
    """``x``'s element count as a float64 0-d tensor on its device (one fill; a symbolic size
    under ``torch.compile``), for records whose element count the host does not know."""
    return torch.full((), x.numel(), dtype=torch.float64, device=x.device)


def nonfinite(x: Tensor) -> Tensor:
    """Count of NaN/Inf elements (a float, on the tensor's device). Output gradients record
    this rather than :func:`finite`: under ``torch.compile`` their records (``probes.summary``)
    do not know their element count on the host, which would take the finite count from it."""
    return x.numel() - finite(x)


def norms(tensors: Sequence[Tensor]) -> list[Tensor]:
    """L2 norms of many tensors in one op, accumulated in float64 (see :func:`norm`)."""
    return foreach_norm(tensors, torch.float64)


def stacked_norms(tensors: Sequence[Tensor]) -> Tensor:
    """:func:`norms` as one float64 vector on the first tensor's device (norms on other devices, of
    a model over several GPUs, are copied there without a sync)."""
    device = tensors[0].device
    return torch.stack([n if n.device == device else n.to(device, non_blocking=True) for n in norms(tensors)])


def norm(x: Tensor) -> Tensor:
    """The L2 norm of ``x``, finite for any finite tensor: accumulated in float64, in the one
    reduction (its sum of squares in float32 overflows once the norm passes 1.8e19, an exploding
    gradient's 1.8e21 read as Inf). On a GPU that costs nothing (memory-bound); on the CPU the
    reduction is slower, as exact CPU statistics cost what they cost; nothing is read on the host."""
    wide: Tensor = torch.linalg.vector_norm(x, dtype=torch.float64)
    return wide


def sparse_values(g: Tensor) -> tuple[Tensor, Tensor]:
    """The values of a sparse COO tensor (a sparse ``.grad``) with those of repeated indices added
    up, as the dense tensor holds them: for the norm, one row per stored entry, sums first,
    then zero rows; for the histogram, the same with NaN rows (left out of histograms). As
    ``coalesce()``, but without its host sync (how many indices are distinct is known only on
    the device). An accumulated sparse ``.grad`` repeats every index looked up more than once."""
    indices, values = sparse_parts(g)
    if g.is_coalesced() or values.shape[0] < 2:
        return values, values
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


def mean_and_centred_norm(x: Tensor, units: int) -> dict[str, Tensor]:
    """The mean and the L2 norm of ``x - mean`` (float32 or wider): centring costs one pass and
    keeps the standard deviation accurate when |mean| >> std."""
    dtype = acc_dtype(x.dtype)
    mean = x.mean(dtype=dtype)
    # 16-bit inputs are centred in float32: a 16-bit x - mean would round each term.
    centred = x - mean if x.dtype == dtype else x.to(dtype).sub_(mean)
    return {"mean": mean, "centred_norm": torch.linalg.vector_norm(centred)}


def extremes(x: Tensor, units: int) -> dict[str, Tensor]:
    """The smallest and largest element, in one op."""
    lo, hi = torch.aminmax(x)
    return {"min": lo, "max": hi}


def per_unit(x: Tensor, units: int, reduce: Callable[..., Tensor]) -> Tensor:
    """``reduce`` (``torch.amax``, ``torch.amin``) of ``x`` per unit, along dim ``units`` (see
    :func:`units_dim`); empty for a 0-d or 1-d ``x``."""
    if x.dim() < 2:
        return x.new_empty(0)
    units %= x.dim()
    return reduce(x, dim=tuple(d for d in range(x.dim()) if d != units))


def unit_peaks(x: Tensor, units: int) -> dict[str, Tensor]:
    """Per unit the largest value (:func:`per_unit`)."""
    return {"peak": per_unit(x, units, torch.amax)}


#: Modules whose outputs hold their units along dim 1 (``N, C, ...``): convolutions and the
#: norms that follow them. Every other module's units are its output's last dim (Linear,
#: GPT-2's Conv1D, attention, RNNs, LayerNorm: ``..., features``).
CHANNELS_FIRST = (
    torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
    torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d,
    torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d, torch.nn.SyncBatchNorm,
    torch.nn.InstanceNorm1d, torch.nn.InstanceNorm2d, torch.nn.InstanceNorm3d, torch.nn.GroupNorm,
)  # fmt: skip


def units_dim(module: torch.nn.Module) -> int:
    """The dim of ``module``'s outputs (and inputs) that holds its units, for dead-unit counts."""
    return 1 if isinstance(module, CHANNELS_FIRST) else -1


def log_partition(z: Tensor, units: int) -> dict[str, Tensor]:
    """Of the logits ``z`` (at least 1-d; the last dim is the vocabulary), ``log Z = log Σ exp(z)``
    per token with ``torch.logsumexp`` in float32 (float64 for float64 logits): their sum, sum of
    squares, maximum and count (``logits=``, ``kinds.LOG_PARTITION``)."""
    lse = z.to(acc_dtype(z.dtype)).logsumexp(dim=-1)
    return {
        "log_z": lse.sum(),
        "log_z_squares": lse.square().sum(),
        "log_z_max": lse.amax(),
        "tokens": lse.new_full((), lse.numel()),
    }
