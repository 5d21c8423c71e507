"""The device values the fused kernels (``fused.py``) give of a tensor, named once, by the names
the torch reductions give them: what a measure declared ``fused=True`` (``stats/kinds.py``) may
have as fields, checked when it is declared. Importable without Triton (``fused.py`` indexes its
buffers by these names, and a machine without a GPU still refuses a measure the kernels would
not give)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, MutableMapping

from torch import Tensor

from ..stats import numerics

#: The float values (float64), in their order in the kernels' output: the moments, the extremes,
#: the L2 norm, the amax, and the powers relative to it (``numerics.measure``'s ``ref``,
#: ``sum2``, ``sum4``).
SCALARS = ("mean", "centred_norm", "min", "max", "norm", "amax", "ref", "sum2", "sum4")
#: The tensor's own counts (int64), first in the kernels' counts.
TOTALS = ("nonzero", "finite", "nonfinite")
#: The kernels' counts, in order: :data:`TOTALS`, then every format's (``numerics.COUNTED``),
#: given as one vector, :data:`FORMAT_COUNTS` (with ``numerics=``; else zeros).
COUNTS = (*TOTALS, *numerics.COUNTED)
FORMAT_COUNTS = numerics.COUNTS
#: Per unit (along the units dim, with ``per_unit``), the largest value and the largest magnitude.
PER_UNIT = ("peak", "unit_amax")
#: Every device value a call of the kernels gives, by name.
OUTPUTS = (*SCALARS, *TOTALS, FORMAT_COUNTS, *PER_UNIT)


def slots(width: int | None) -> dict[str, tuple[int, int, tuple[int, ...]]]:
    """Where each value lies in the one float64 buffer a call of the kernels fills (``fused.py``):
    ``{name: (offset, length, shape)}``: the :data:`SCALARS`, the :data:`COUNTS` (exact in float64
    below 2**53), then, per unit of ``width`` (``None``: no per-unit values), each :data:`PER_UNIT` row."""
    out: dict[str, tuple[int, int, tuple[int, ...]]] = {name: (i, 1, ()) for i, name in enumerate(SCALARS)}
    at = len(SCALARS)
    out.update((name, (at + i, 1, ())) for i, name in enumerate(TOTALS))
    out[FORMAT_COUNTS] = (at + len(TOTALS), len(numerics.COUNTED), (len(numerics.COUNTED),))
    at += len(COUNTS)
    if width is not None:
        out.update((name, (at + i * width, width, (width,))) for i, name in enumerate(PER_UNIT))
    return out


def size(width: int) -> int:
    """Elements of the buffer of :func:`slots` (``width``)."""
    return len(SCALARS) + len(COUNTS) + len(PER_UNIT) * width


class Fused(MutableMapping[str, Tensor]):
    """A tensor's device values by name, those of the kernels lying in their one ``buffer`` (at
    :func:`slots`), the others (``compute`` of the measures the kernels do not give) tensors of
    their own. A value of the buffer is a view of it made when first read; a record takes the
    buffer whole (``packing.Record.of``), so that packing copies it with one op and makes no view.
    ``sample``: the tensor's histogram sample, where the kernels took it."""

    def __init__(
        self, buffer: Tensor, slots: dict[str, tuple[int, int, tuple[int, ...]]], sample: Tensor | None = None
    ) -> None:
        self.buffer = buffer
        self.slots = slots
        self.sample = sample
        self.own: dict[str, Tensor] = {}  # (set after the kernels: a value of the buffer replaced)
        self._views: dict[str, Tensor] = {}

    def copy(self) -> Fused:
        out = Fused(self.buffer, self.slots, self.sample)
        out.own.update(self.own)
        return out

    def __getitem__(self, name: str) -> Tensor:
        if name in self.own:
            return self.own[name]
        if name not in self._views:
            offset, length, shape = self.slots[name]
            self._views[name] = self.buffer[offset : offset + length].view(shape)
        return self._views[name]

    def __setitem__(self, name: str, value: Tensor) -> None:
        self.own[name] = value

    def __delitem__(self, name: str) -> None:
        raise TypeError("the kernels' values are not removed")

    def __iter__(self) -> Iterator[str]:
        yield from self.slots
        yield from (name for name in self.own if name not in self.slots)

    def __len__(self) -> int:
        return len(self.slots) + sum(name not in self.slots for name in self.own)

    def __contains__(self, name: object) -> bool:
        return name in self.slots or name in self.own

    def in_buffer(self, name: str) -> tuple[int, int] | None:
        """``(offset, length)`` of a value that lies in the buffer, as the kernels gave it; else ``None``."""
        at = None if name in self.own else self.slots.get(name)
        return None if at is None else at[:2]


def copied_sample(named: Mapping[str, Tensor]) -> Tensor | None:
    """The histogram sample the kernels copied with a tensor's values ``named``; ``None`` where
    they did not (the torch path, or no sample asked for)."""
    return named.sample if isinstance(named, Fused) else None
