"""What a logged step records, declared once: each record kind says what it computes on the
device, its fields, how repeated records of one module pool (several calls, micro-batches,
ranks) and which scalars they become.

A hook appends a :class:`Record` holding device tensors. At the end of the step
:func:`pack` turns every record into one float64 tensor (a handful of ops for the whole step)
and a host-side :class:`Layout` of :class:`Entry` objects that say where each field landed;
:func:`pooled` reads them back and pools them per module. Adding a statistic is one change
to a kind below: its device function, its field, its scalar.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .stats import acc_dtype, finite, nonfinite
from .tags import tag

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


@dataclass(frozen=True, eq=False)
class Kind:
    """A kind of record: its fields, and the scalars a module's pooled fields become. Compared
    and hashed by identity: each kind is one object, looked up for every record of a step."""

    name: str
    fields: tuple[Field, ...]
    scalars: Callable[[Values, int], dict[str, float]]  # (pooled fields, elements in all records) -> {stat: value}
    #: Pooled over ranks with ``reduce_ranks=True`` (one record per call); otherwise the writing rank's own.
    per_call: bool = False
    #: The record's values of a tensor, in field order (call under ``no_grad``); for kinds
    #: recorded from a tensor's statistics.
    compute: Callable[[Tensor], tuple[Tensor, ...]] | None = None

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


def _finite(stat: str, value: float) -> dict[str, float]:
    """A scalar left out where undefined (the update ratio of an all-zero weight)."""
    return {stat: value} if math.isfinite(value) else {}


def _nonfinite(v: Values, count: int) -> float:
    """NaN/Inf count of pooled records that hold a ``finite`` count of their ``count`` elements."""
    return float(count - v["finite"][0])


def _tensor_values(x: Tensor) -> tuple[Tensor, ...]:
    """Exact statistics of ``x``: mean and centred L2 norm (float32 or wider; centring costs one
    pass and keeps the standard deviation accurate when |mean| >> std), min, max, nonzero and
    finite counts, and per channel (dim 1) the largest value."""
    dtype = acc_dtype(x.dtype)
    mean = x.mean(dtype=dtype)
    # 16-bit inputs are centred in float32: a 16-bit x - mean would round each term.
    centred = x - mean if x.dtype == dtype else x.to(dtype).sub_(mean)
    lo, hi = torch.aminmax(x)
    peak = x.amax(dim=(0, *range(2, x.dim()))) if x.dim() >= 2 else x.new_empty(0)
    return mean, torch.linalg.vector_norm(centred), lo, hi, torch.count_nonzero(x), finite(x), peak


def _tensor_scalars(v: Values, count: int) -> dict[str, float]:
    """Activation (and input) statistics of the pooled calls, as if their tensors were concatenated."""
    mean, norm = v["moments"]
    out = {
        "mean": float(mean),
        "std": float(norm) / math.sqrt(count - 1) if count > 1 else 0.0,  # unbiased, as torch.std
        "min": float(v["min"][0]),
        "max": float(v["max"][0]),
        "zero_frac": float((count - v["nonzero"][0]) / count),
        "nonfinite": _nonfinite(v, count),
    }
    peaks = v["peak"]
    if peaks.size:  # a channel is dead if it is never positive across the pooled batch
        out["dead_frac"] = float(np.count_nonzero(peaks <= 0) / peaks.size)
    return out


def _gradient_values(g: Tensor) -> tuple[Tensor, ...]:
    """L2 norm (float32 or wider) and non-finite count of a gradient. Its extremes are taken
    only for a linear histogram (``Collector._record``): not a scalar, and not a default histogram."""
    return torch.linalg.vector_norm(g, dtype=acc_dtype(g.dtype)), nonfinite(g)


def _gradient_scalars(v: Values, count: int) -> dict[str, float]:
    return {"norm": float(v["norm"][0]), "nonfinite": float(v["nonfinite"][0])}


_TENSOR_FIELDS = (
    Field("moments", _pool_moments, parts=2),  # mean, L2 norm of (x - mean): accurate when |mean| >> std
    Field("min", _pool_min),
    Field("max", _pool_max),
    Field("nonzero", _pool_sum),
    Field("finite", _pool_sum),  # the host knows the elements: NaN/Inf are the rest
    Field("peak", _pool_max),  # per channel (dim 1): the largest value, for dead units
)
#: A watched module's output (``activation/*``) and, with ``inputs=True``, its input (``input/*``).
ACTIVATION = Kind("activation", _TENSOR_FIELDS, _tensor_scalars, per_call=True, compute=_tensor_values)
INPUT = Kind("input", _TENSOR_FIELDS, _tensor_scalars, per_call=True, compute=_tensor_values)
#: The gradient w.r.t. a module's output: ``gradient/norm`` and ``gradient/nonfinite``.
GRADIENT = Kind(
    "gradient",
    (Field("norm", _pool_norm), Field("nonfinite", _pool_sum)),
    _gradient_scalars,
    per_call=True,
    compute=_gradient_values,
)
#: A parameter's final gradient: ``param_grad/norm`` (``param_grad/global_norm`` is derived from all).
PARAM_GRAD = Kind("param_grad", (Field("norm", _pool_first),), lambda v, n: {"norm": float(v["norm"][0])})
#: A tensor's NaN/Inf count logged under its own tag (``input/nonfinite``), recorded as its
#: finite count (``stats.finite``); the records of a tag add up.
NONFINITE = Kind("nonfinite", (Field("finite", _pool_sum),), lambda v, n: {"": _nonfinite(v, n)}, per_call=True)
#: A device value logged under its own tag (``param/update_ratio``, ``amp/*``); the first record.
SCALAR = Kind("scalar", (Field("value", _pool_first),), lambda v, n: _finite("", float(v["value"][0])))
#: An image in [0, 1] (feature maps); the first record of a step.
IMAGE = Kind("image", (Field("pixels", _pool_first),), lambda v, n: {})
#: Every histogram of the step: rows ``[start, span, min, max, counts...]`` (``stats.histograms``).
HISTOGRAM = Kind("histogram", (Field("rows", _pool_first),), lambda v, n: {})

# Histogram kinds (tag roots) besides the record kinds above.
PARAM, GRADIENT_LOG10 = "param", "gradient_log10"


class Record(NamedTuple):
    """What a hook recorded: device tensors, one per field of ``kind``, in field order."""

    kind: Kind
    name: str
    numel: int  # elements of the tensor it describes
    values: tuple[Tensor, ...]
    shape: tuple[int, ...] = ()  # of an image


class HistMeta(NamedTuple):
    """What one histogram row describes: ``kind/name``, of a tensor of ``numel`` elements, from
    ``sampled`` of them."""

    kind: str
    name: str
    numel: int
    sampled: int


@dataclass(frozen=True)
class Entry:
    """A record on the host: where its fields are in the packed array."""

    kind: Kind
    name: str
    numel: int
    spans: tuple[tuple[int, int], ...]  # (offset, length) per field
    shape: tuple[int, ...] = ()

    def read(self, values: np.ndarray) -> Values:
        out, spans = {}, iter(self.spans)
        for f in self.kind.fields:
            if f.parts == 1:
                a, n = next(spans)
                out[f.name] = values[a : a + n]
            else:
                out[f.name] = np.concatenate([values[a : a + n] for a, n in itertools.islice(spans, f.parts)])
        return out


@dataclass
class Layout:
    """Host-side description of a packed step: one :class:`Entry` per record, in record order."""

    entries: list[Entry] = field(default_factory=list)
    size: int = 0
    hists: list[HistMeta] = field(default_factory=list)  # the rows of the HISTOGRAM entry

    def of(self, *kinds: Kind) -> list[Entry]:
        return [e for e in self.entries if e.kind in kinds]


def pack(records: Sequence[Record], device: torch.device) -> tuple[Tensor, Layout]:
    """Every record's values in one float64 tensor on ``device``: 0-d values of one dtype are
    stacked with one op, vectors concatenated with one, so the op count does not grow with the
    number of records."""
    groups: dict[tuple[torch.device, torch.dtype, bool], list[Tensor]] = {}
    where: list[tuple[tuple[torch.device, torch.dtype, bool], int]] = []  # per value: group, index
    for record in records:
        for t in record.values:
            key = (t.device, t.dtype, t.dim() == 0)
            group = groups.setdefault(key, [])
            where.append((key, len(group)))
            group.append(t)
    starts: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
    parts = []
    offset = 0
    for key, group in groups.items():
        lengths = [1 if key[2] else t.numel() for t in group]
        starts[key] = (offset + np.cumsum([0, *lengths[:-1]])).tolist()
        offset += sum(lengths)
        joined = torch.stack(group) if key[2] else torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in group])
        parts.append(joined.to(device, torch.float64, non_blocking=True))
    layout = Layout(size=offset)
    values = iter(where)
    for record in records:
        spans = []
        for t in record.values:
            key, index = next(values)
            spans.append((starts[key][index], 1 if key[2] else t.numel()))
        layout.entries.append(Entry(record.kind, record.name, record.numel, tuple(spans), record.shape))
    return torch.cat(parts) if len(parts) > 1 else parts[0], layout


def pooled(entries: Iterable[Entry], values: np.ndarray) -> dict[tuple[Kind, str], tuple[Values, int]]:
    """Fields of every (kind, module), pooled over its records with each field's rule; and the
    number of elements they cover."""
    grouped: dict[tuple[Kind, str], list[Entry]] = {}
    for entry in entries:
        grouped.setdefault((entry.kind, entry.name), []).append(entry)
    out = {}
    for (kind, name), group in grouped.items():
        if len(group) == 1:  # pooling one record changes nothing
            out[(kind, name)] = (group[0].read(values), group[0].numel)
            continue
        counts = np.array([e.numel for e in group], dtype=np.float64)
        read = [e.read(values) for e in group]
        fields = {}
        for f in kind.fields:
            rows = [r[f.name] for r in read]
            if len({row.size for row in rows}) > 1:  # calls with other channel counts: channels side by side
                fields[f.name] = np.concatenate(rows)
                continue
            fields[f.name] = f.pool(np.stack(rows), counts)
        out[(kind, name)] = (fields, int(counts.sum()))
    return out


def scalars(entries: Iterable[Entry], values: np.ndarray) -> dict[str, float]:
    """``{tag: value}`` of every pooled record (``param_grad/global_norm`` included)."""
    out: dict[str, float] = {}
    norms = []
    for (kind, name), (fields, count) in pooled(entries, values).items():
        for stat, value in kind.scalars(fields, count).items():
            out[tag(kind.name, stat, name) if stat else name] = value
        if kind is PARAM_GRAD:
            norms.append(fields["norm"][0])
    if norms:
        out[tag(PARAM_GRAD.name, "global_norm")] = math.sqrt(float(np.sum(np.square(norms))))
    return out
