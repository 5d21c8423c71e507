"""One logged step's records packed into one float64 tensor on the device, and read back on the host.

A hook appends a :class:`Record` holding device tensors. At the end of the step :func:`pack_step`
bins the step's histogram samples and turns every record into one float64 tensor (a handful of
ops for the whole step) and a host-side :class:`StepLayout` of :class:`Entry` objects that say
where each field landed; :func:`pooled` reads them back and pools them per module, as each
field of its kind declares.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from torch import Tensor

from ..kernels.outputs import Fused
from .binning import HIST_WIDTH, RowInfo, Sample, bin_step
from .kinds import Computed, Field, Kind, Measure, Values
from .recipe import Recipe, Source
from .sampling import IndexCache
from .tags import tag

if TYPE_CHECKING:
    from ..kernels import Kernels
    from ..topology.sharding import Split


class Record(NamedTuple):
    """What a hook recorded: device tensors, one per field of ``kind``, in field order."""

    kind: Kind
    name: str
    numel: int  # elements of the tensor it describes
    values: tuple[Tensor, ...]
    shape: tuple[int, ...] = ()  # of an image
    #: Of one rank's piece of a tensor split over ranks: the other pieces' ranks.
    split: Split | None = None
    #: Where each value (``kind``'s, in field order) lies, ``(index in values, offset, length)``,
    #: where ``values`` are whole buffers holding them (the fused kernels' buffer, :meth:`of`);
    #: ``None``: each value is a tensor of ``values`` of its own.
    spans: tuple[tuple[int, int, int], ...] | None = None

    @classmethod
    def of(cls, kind: Kind, name: str, numel: int, named: Computed, split: Split | None = None) -> Record:
        """The record of ``kind``'s values of a tensor (``Kind.compute``'s): those in the fused
        kernels' buffer by their place in it, the buffer kept whole (packed with one copy and
        no view, once for every record of the tensor), the others as they are."""
        names = [n for f in kind.fields for n in f.names]
        at = [named.in_buffer(n) for n in names] if isinstance(named, Fused) else []
        if not any(at):
            return cls(kind, name, numel, kind.values(named), split=split)
        assert isinstance(named, Fused)  # (what has a buffer)
        values, spans = [named.buffer], []
        for n, place in zip(names, at):
            if place is None:
                t = named[n]
                spans.append((len(values), 0, 1 if t.dim() == 0 else t.numel()))
                values.append(t)
            else:
                spans.append((0, *place))
        return cls(kind, name, numel, tuple(values), split=split, spans=tuple(spans))

    def placed(self) -> list[tuple[Tensor, int, int]]:
        """Each value as ``(tensor, offset, length)``: a slice of a tensor of ``values``; a 0-d
        value's length is 1."""
        if self.spans is None:
            return [(t, 0, 1 if t.dim() == 0 else t.numel()) for t in self.values]
        return [(self.values[i], offset, length) for i, offset, length in self.spans]


@dataclass(frozen=True)
class Entry:
    """A record on the host: where its fields are in the packed array."""

    kind: Kind
    name: str
    numel: int
    spans: tuple[tuple[int, int], ...]  # (offset, length) per field
    shape: tuple[int, ...] = ()
    split: Split | None = None
    #: Of a piece of a tensor split along its units: the piece's position, so that per-unit
    #: fields of the pieces are put side by side (``Field.per_unit``).
    part: int | None = None

    def read(self, values: np.ndarray) -> Values:
        out, spans = {}, iter(self.spans)
        for f in self.kind.fields:
            if len(f.names) == 1:
                a, n = next(spans)
                out[f.name] = values[a : a + n]
            else:
                out[f.name] = np.concatenate([values[a : a + n] for a, n in itertools.islice(spans, len(f.names))])
        return out


@dataclass
class StepLayout:
    """Host-side description of a packed step: one :class:`Entry` per record, in record order,
    of the kinds of ``recipe``."""

    recipe: Recipe
    entries: list[Entry] = field(default_factory=list)
    size: int = 0
    #: The histogram rows of the BINNED entries, in their order (one entry a rank's step: several
    #: where the steps of pipeline stages are combined, ``transport.stages.merged``).
    rows: list[RowInfo] = field(default_factory=list)

    def of(self, *kinds: Kind) -> list[Entry]:
        return [e for e in self.entries if e.kind in kinds]


def pack(records: Sequence[Record], device: torch.device, recipe: Recipe) -> tuple[Tensor, StepLayout]:
    """Every record's values in one float64 tensor on ``device``: 0-d values of one dtype are
    stacked with one op, vectors and buffers (each once, however many records hold it)
    concatenated with one, so the op count does not grow with the number of records."""
    Group = tuple[torch.device, torch.dtype, bool]
    groups: dict[Group, list[Tensor]] = {}
    placed: dict[int, tuple[Group, int]] = {}  # id of a tensor packed: its group and index there
    where: list[tuple[Group, int, int, int]] = []  # per value: group, index, offset in its tensor, length
    for record in records:
        if not record.values:
            continue
        on = record.values[0].device  # (a record's values are of one tensor: on its device)
        for t, offset, length in record.placed():
            if id(t) not in placed:
                key = (on, t.dtype, t.dim() == 0)
                group = groups.setdefault(key, [])
                placed[id(t)] = (key, len(group))
                group.append(t)
            where.append((*placed[id(t)], offset, length))
    starts: dict[Group, list[int]] = {}
    parts = []
    offset = 0
    for key, group in groups.items():
        lengths = [1 if key[2] else t.numel() for t in group]
        starts[key] = (offset + np.cumsum([0, *lengths[:-1]])).tolist()
        offset += sum(lengths)
        joined = torch.stack(group) if key[2] else torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in group])
        parts.append(joined.to(device, torch.float64, non_blocking=True))
    layout = StepLayout(recipe, size=offset)
    values = iter(where)
    for record in records:
        spans = []
        for _ in record.placed():
            key, index, within, length = next(values)
            spans.append((starts[key][index] + within, length))
        layout.entries.append(Entry(record.kind, record.name, record.numel, tuple(spans), record.shape, record.split))
    return torch.cat(parts) if len(parts) > 1 else parts[0], layout


def pooled(entries: Iterable[Entry], values: np.ndarray) -> dict[tuple[Kind, str], tuple[Values, int]]:
    """Fields of every (kind, module), pooled over its records with each field's rule; and the
    number of elements they cover."""
    grouped: dict[tuple[Kind, str], list[Entry]] = {}
    for entry in entries:
        grouped.setdefault((entry.kind, entry.name), []).append(entry)
    out = {}
    for (kind, name), group in grouped.items():
        read = [e.read(values) for e in group]
        if len(group) == 1:  # pooling one record changes nothing
            out[(kind, name)] = (read[0], kind.numel(read[0], group[0].numel))
            continue
        counts = np.array([kind.numel(r, e.numel) for r, e in zip(read, group)], dtype=np.float64)
        fields = {}
        for f in kind.fields:
            rows = [r[f.name] for r in read]
            if f.per_unit and any(e.part is not None for e in group):
                fields[f.name] = _side_by_side(f, rows, [e.part or 0 for e in group])
            elif len({row.size for row in rows}) > 1:  # tensors of other channel counts: channels side by side
                fields[f.name] = _by_size(f, rows, counts)
            else:
                fields[f.name] = f.pool.combine(np.stack(rows), counts)
        out[(kind, name)] = (fields, int(counts.sum()))
    return out


def _by_size(f: Field, rows: list[np.ndarray], counts: np.ndarray) -> np.ndarray:
    """A per-unit field of tensors with other unit counts (a block's input and its table of
    angles): those of one count pooled, as the pieces or calls of one tensor; the counts side by
    side, in first-seen order."""
    sizes: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        sizes.setdefault(row.size, []).append(i)
    return np.concatenate([f.pool.combine(np.stack([rows[i] for i in at]), counts[at]) for at in sizes.values()])


def _side_by_side(f: Field, rows: list[np.ndarray], parts: list[int]) -> np.ndarray:
    """A per-unit field of pieces split along the units: each piece's units pooled over its
    calls, then the pieces side by side, in mesh order."""
    by_part: dict[int, list[np.ndarray]] = {}
    for part, row in zip(parts, rows):
        by_part.setdefault(part, []).append(row)
    pooled_parts = [f.pool.combine(np.stack(by_part[p]), np.ones(len(by_part[p]))) for p in sorted(by_part)]
    return np.concatenate(pooled_parts)


#: What a scalar is: its kind, the measure that made it and its statistic.
Meaning = tuple[Kind, Measure, str]


def scalars(
    entries: Iterable[Entry], values: np.ndarray, meaning: dict[str, Meaning] | None = None
) -> dict[str, float]:
    """``{tag: value}`` of every pooled record, and the whole-model totals of the measures that
    declare one (``param_grad/global_norm``); what each tag is goes into ``meaning``."""
    out: dict[str, float] = {}
    totals: dict[str, tuple[Kind, list[float]]] = {}
    for (kind, name), (fields, count) in pooled(entries, values).items():
        for measure in kind.measures:
            for stat, value in measure.scalars(fields, count).items():
                key = tag(kind.name, stat, name) if stat else name
                out[key] = value
                if meaning is not None:
                    meaning[key] = (kind, measure, stat)
            if measure.total is not None:
                (field,) = measure.fields
                key = tag(kind.name, measure.total)
                totals.setdefault(key, (kind, []))[1].append(fields[field.name][0])
                if meaning is not None:
                    meaning[key] = (kind, measure, measure.total)
    for key, (_, norms) in totals.items():
        out[key] = math.sqrt(float(np.sum(np.square(norms))))
    return out


def pack_step(
    records: list[Record],
    samples: list[Sample],
    kinds: frozenset[str],
    cache: IndexCache,
    recipe: Recipe,
    kernels: Kernels | None = None,
) -> tuple[Tensor, StepLayout] | None:
    """Bin the step's histogram samples of ``kinds`` (with the ``kernels`` where they take them)
    and pack every record (of ``recipe``'s kinds) into one float64 tensor on the device of the
    first; ``None`` when nothing was recorded."""
    if not records and not samples:
        return None
    device = (records[0].values[0] if records else samples[0].sample).device
    binned, rows = bin_step(samples, device, kinds, cache, kernels)
    if rows:
        binned_kind = recipe[Source.BINNED]
        records = [*records, Record(binned_kind, "", binned.numel(), (binned,), (len(rows), HIST_WIDTH))]
    if not records:
        return None
    packed, layout = pack(records, device, recipe)
    layout.rows = rows
    return packed, layout
