"""What a logged step records, declared once: each record kind says what it computes on the
device, its fields, how repeated records of one module pool (several calls, micro-batches,
ranks) and which scalars they become.

Adding a statistic is one change to a kind below: its device function, its field, its scalar
(named in :class:`~tblog_hooks.stats.tags.Stat`). ``packing.py`` moves the fields to the host and
pools them; the tag table in the docs lists the scalars each kind declares.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from .reductions import gradient_statistics, tensor_statistics
from .tags import Root, Stat

Values = dict[str, np.ndarray]


def _pool_sum(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return values.sum(axis=0)  # type: ignore[no-any-return]


def _pool_min(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return values.min(axis=0)  # type: ignore[no-any-return]  # NaN propagates, as in torch.aminmax


def _pool_max(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return values.max(axis=0)  # type: ignore[no-any-return]


def _pool_first(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    return values[0]  # type: ignore[no-any-return]


def _pool_norm(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """L2 norm over all records: the root of the summed squares."""
    return np.sqrt(np.square(values).sum(axis=0))  # type: ignore[no-any-return]


def _pool_moments(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """``[mean, centred norm]`` of the concatenation of records holding the same (Chan et al.'s
    parallel variance)."""
    n, (mean, norm) = counts[0], values[0]
    m2 = norm * norm
    for count, (mean_b, norm_b) in zip(counts[1:], values[1:]):
        total = n + count
        delta = mean_b - mean
        m2 = m2 + norm_b * norm_b + delta * delta * n * count / total
        mean = mean + delta * count / total
        n = total
    return np.array([mean, math.sqrt(m2)])


@dataclass(frozen=True)
class Field:
    """One recorded value, from ``parts`` device tensors (0-d, or 1-d such as one value per channel)."""

    name: str
    pool: Callable[[np.ndarray, np.ndarray], np.ndarray]  # (values per record, elements per record) -> pooled
    parts: int = 1
    #: One value per unit of the module (its pieces, where the units are split over ranks, go side by side).
    per_unit: bool = False


@dataclass(frozen=True, eq=False)
class Kind:
    """A kind of record: its fields, and the scalars a module's pooled fields become. Compared
    and hashed by identity: each kind is one object, looked up for every record of a step."""

    #: The tag root of its scalars (``{name}/{stat}/{module}``) and histograms; kinds whose
    #: records are tagged by their own names have a name of their own.
    name: str
    fields: tuple[Field, ...]
    #: (pooled fields, elements in all records) -> ``{stat: value}``; the stat ``""`` tags a
    #: record by its own name (a whole tag, e.g. ``input/nonfinite/{module}``).
    scalars: Callable[[Values, int], dict[str, float]]
    #: The statistics its scalars are tagged with (for the tag table).
    stats: tuple[Stat, ...] = ()
    #: Pooled over ranks with ``reduce_ranks=True`` (one record per call); otherwise the writing rank's own.
    per_call: bool = False
    #: The record's values of a tensor, in field order (call under ``no_grad``), given the dim
    #: that holds its units (``reductions.units_dim``); for kinds recorded from a tensor's statistics.
    compute: Callable[[Tensor, int], tuple[Tensor, ...]] | None = None
    #: Every field is an L2 norm: those of a tensor's pieces on several ranks combine as the root
    #: of their summed squares.
    norms: bool = False

    def has(self, name: str) -> bool:
        """Whether records of this kind hold the field ``name``."""
        return any(f.name == name for f in self.fields)

    def value(self, values: Sequence[Tensor], name: str) -> Tensor:
        """The device value of the one-part field ``name`` among a record's ``values``."""
        position = 0
        for f in self.fields:
            if f.name == name:
                return values[position]
            position += f.parts
        raise KeyError(name)


def _finite(value: float) -> dict[str, float]:
    """A scalar left out where undefined (the update ratio of an all-zero weight)."""
    return {"": value} if math.isfinite(value) else {}


def _ratio(change: float, weight: float) -> dict[str, float]:
    """The update ratio where defined (not of an all-zero or non-finite weight)."""
    ratio = change / weight if weight > 0 else math.nan
    return {Stat.UPDATE_RATIO: ratio} if math.isfinite(ratio) else {}


def _nonfinite(v: Values, count: int) -> float:
    """NaN/Inf count of pooled records that hold a ``finite`` count of their ``count`` elements."""
    return float(count - v["finite"][0])


def _tensor_scalars(v: Values, count: int) -> dict[str, float]:
    """Activation (and input) statistics of the pooled calls, as if their tensors were concatenated."""
    mean, norm = v["moments"]
    out = {
        Stat.MEAN: float(mean),
        Stat.STD: float(norm) / math.sqrt(count - 1) if count > 1 else 0.0,  # unbiased, as torch.std
        Stat.MIN: float(v["min"][0]),
        Stat.MAX: float(v["max"][0]),
        Stat.ZERO_FRAC: float((count - v["nonzero"][0]) / count),
        Stat.NONFINITE: _nonfinite(v, count),
    }
    peaks = v["peak"]
    if peaks.size:  # a unit is dead if it is never positive across the pooled batch
        out[Stat.DEAD_FRAC] = float(np.count_nonzero(peaks <= 0) / peaks.size)
    return out  # type: ignore[return-value]  # (Stat is a str)


_TENSOR_FIELDS = (
    Field("moments", _pool_moments, parts=2),  # mean, L2 norm of (x - mean): accurate when |mean| >> std
    Field("min", _pool_min),
    Field("max", _pool_max),
    Field("nonzero", _pool_sum),
    Field("finite", _pool_sum),  # the host knows the elements: NaN/Inf are the rest
    Field("peak", _pool_max, per_unit=True),  # per unit: the largest value, for dead units
)
_TENSOR_STATS = (Stat.MEAN, Stat.STD, Stat.MIN, Stat.MAX, Stat.ZERO_FRAC, Stat.NONFINITE, Stat.DEAD_FRAC)
#: A watched module's output (``activation/*``).
ACTIVATION = Kind(Root.ACTIVATION, _TENSOR_FIELDS, _tensor_scalars, _TENSOR_STATS, True, tensor_statistics)
#: With ``inputs=True``, a watched module's input (``input/*``).
INPUT = Kind(Root.INPUT, _TENSOR_FIELDS, _tensor_scalars, _TENSOR_STATS, True, tensor_statistics)
#: The gradient w.r.t. a module's output: ``gradient/norm`` and ``gradient/nonfinite``.
GRADIENT = Kind(
    Root.GRADIENT,
    (Field("norm", _pool_norm), Field("nonfinite", _pool_sum)),
    lambda v, n: {Stat.NORM: float(v["norm"][0]), Stat.NONFINITE: float(v["nonfinite"][0])},
    (Stat.NORM, Stat.NONFINITE),
    per_call=True,
    compute=gradient_statistics,
)
#: A parameter's final gradient: ``param_grad/norm`` (``param_grad/global_norm`` is derived from all).
PARAM_GRAD = Kind(
    Root.PARAM_GRAD,
    (Field("norm", _pool_first),),
    lambda v, n: {Stat.NORM: float(v["norm"][0])},
    (Stat.NORM,),
    norms=True,
)
#: An optimizer step's change of a parameter, ``||W_after - W_before|| / ||W_before||``
#: (``param/update_ratio``; left out where the weight is all zeros).
UPDATE = Kind(
    Root.PARAM,
    (Field("change", _pool_first), Field("weight", _pool_first)),
    lambda v, n: _ratio(float(v["change"][0]), float(v["weight"][0])),
    (Stat.UPDATE_RATIO,),
    norms=True,
)
#: Without ``inputs=True``, the NaN/Inf count of a watched module's inputs alone
#: (``input/nonfinite/{module}``), recorded as their finite count (``reductions.finite``).
NONFINITE_COUNT = Kind(
    Root.INPUT,
    (Field("finite", _pool_sum),),
    lambda v, n: {Stat.NONFINITE: _nonfinite(v, n)},
    (Stat.NONFINITE,),
    per_call=True,
)
#: A device value logged under its own tag (``amp/*``); the first record.
SCALAR = Kind("scalar", (Field("value", _pool_first),), lambda v, n: _finite(float(v["value"][0])))
#: A module's feature maps, an image in [0, 1] (``feature_map/{module}``); the first record of a step.
IMAGE = Kind(Root.FEATURE_MAP, (Field("pixels", _pool_first),), lambda v, n: {})


def _attention_scalars(v: Values, count: int) -> dict[str, float]:
    """A module's attention calls pooled over heads: the largest logit, the mean entropy per query."""
    queries = float(v["queries"].sum())
    out = {Stat.MAX_LOGIT: float(v["max_logit"].max())}
    if queries > 0:
        out[Stat.ENTROPY] = float(v["entropy"].sum()) / queries
    return out  # type: ignore[return-value]  # (Stat is a str)


#: With ``attention=``, the attention calls of a module (``attention/*``; ``stats/attention.py``),
#: one value per head: the largest logit, the summed entropy of its queries and their count. The
#: heads of a tensor-parallel attention, split over ranks, go side by side.
ATTENTION = Kind(
    Root.ATTENTION,
    (
        Field("max_logit", _pool_max, per_unit=True),
        Field("entropy", _pool_sum, per_unit=True),
        Field("queries", _pool_sum, per_unit=True),
    ),
    _attention_scalars,
    (Stat.MAX_LOGIT, Stat.ENTROPY),
    per_call=True,
)
#: Every histogram of the step: rows ``[start, span, min, max, counts...]`` (``binning.bin_rows``).
BINNED = Kind("histogram", (Field("rows", _pool_first),), lambda v, n: {})

#: The kinds whose records become scalars as their ``scalars`` say (attention's are summarised
#: with their per-head values, ``stats/attention.py``).
SCALAR_KINDS = (ACTIVATION, INPUT, GRADIENT, PARAM_GRAD, UPDATE, NONFINITE_COUNT, SCALAR)

#: Every histogram kind, by tag root: ``activation/{module}``, ``input/{module}`` (with
#: ``inputs=True``), ``gradient/{module}`` (output gradient), ``gradient_log10/{module}`` (log10 of
#: its magnitudes), ``param_grad/{module}.{param}``, ``param/{module}.{param}`` (weights).
HISTOGRAM_KINDS: tuple[str, ...] = tuple(
    root.value
    for root in (Root.ACTIVATION, Root.INPUT, Root.GRADIENT, Root.GRADIENT_LOG10, Root.PARAM_GRAD, Root.PARAM)
)
