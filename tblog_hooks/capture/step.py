"""What the hooks of one logged step record, kept on the device until the step ends, and the one
place that decides how a hook records: eagerly, or traced by ``torch.compile``.

Hooks never read a tensor value on the host: each appends :class:`~tblog_hooks.stats.packing.Record`
objects and histogram :class:`~tblog_hooks.stats.binning.Sample` objects here, and at the end of
the step they are binned and packed into one float64 tensor (``packing.pack_step``).
"""

from __future__ import annotations

import abc
import enum
import warnings
from typing import TYPE_CHECKING, Generic, TypeVar, Union

import torch
from torch import Tensor

from .._compat import in_backward, in_functorch_transform
from ..stats import sampling
from ..stats.binning import Sample
from ..stats.kinds import SCALAR, Kind
from ..stats.packing import Record
from ..stats.sampling import IndexCache
from ..stats.schedule import Histograms
from ..stats.tags import Root

if TYPE_CHECKING:
    from ..topology.sharding import Split


class Part(enum.Enum):
    """A part of the logging that is switched off as a whole when it fails; a watched module's
    own statistics are switched off by its name. Not strings: a module may be named like a part."""

    PARAMETERS = "parameters"
    UPDATE_RATIO = "update_ratio"
    ATTENTION = "attention"
    MODULE_STATISTICS = "module statistics"


Item = TypeVar("Item")
Recorded = Union[Record, Sample]
_NO_KINDS: frozenset[str] = frozenset()


class StepBuffer:
    """Per-step buffer of device results, fed by the recorders; holds no module or model.
    Hooks may run on several threads (backward on one thread per device): they only append."""

    def __init__(self, histograms: Histograms | None) -> None:
        #: Whether hooks record now: during a logged step of a logger that is logging.
        self.active = False
        #: Modules (by name) and parts whose logging failed or ended.
        self.disabled: set[str | Part] = set()
        self.indices = IndexCache()  # sample and histogram-row indices, made once per size
        self._schedule = histograms
        self.kinds = _NO_KINDS  # histogram kinds of the current logged step
        self._records: list[Record] = []
        self._samples: list[Sample] = []
        self.eager = Eager(self)
        self.traced = Traced(self, _NO_KINDS if histograms is None else histograms.all_kinds)

    def now(self) -> Mode | None:
        """How the calling hook records: traced while ``torch.compile`` traces it, else eagerly;
        ``None`` inside a ``torch.func`` transform (per-sample gradients, ``vmap(model)``), whose
        wrapped tensors no record could outlive: such a call is not recorded."""
        if torch.compiler.is_compiling():
            return self.traced
        return None if in_functorch_transform() else self.eager

    def begin(self, index: int) -> None:
        """A logged step begins; ``index`` is its number among the logged steps that recorded
        something (see ``Histograms``), which picks the histograms it takes (none: no sampling,
        no binning)."""
        self.kinds = _NO_KINDS if self._schedule is None else self._schedule.kinds_at(index)

    @property
    def empty(self) -> bool:
        """Whether nothing was recorded since the last :meth:`drain`."""
        return not (self._records or self._samples or self.traced.sink)

    def record_scalar(self, key: str, value: Tensor) -> None:
        """A device value logged under the tag ``key`` as it is (the first, if recorded twice)."""
        self._records.append(Record(SCALAR, key, 1, (value,)))

    def drain(self) -> tuple[list[Record], list[Sample]]:
        """Everything the hooks recorded this step, in the order they recorded it; empties the buffer."""
        records, samples = self._records, self._samples
        self._records, self._samples = [], []
        for item in self.traced.sink.drain():
            (samples if isinstance(item, Sample) else records).append(item)  # type: ignore[arg-type]
        return records, samples

    def fail(self, key: str | Part, error: BaseException) -> None:
        """Report a failure once and stop logging ``key`` (a module's name, or a part); training carries on."""
        if key not in self.disabled:
            self.disabled.add(key)
            name = key.value if isinstance(key, Part) else key
            warnings.warn(
                f"tblog_hooks: logging for {name!r} failed and is switched off: {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=2,
            )


class Mode(abc.ABC):
    """How a hook records: where its records go, which histograms it samples and how."""

    #: Whether the hook is being traced by ``torch.compile``.
    compiled: bool

    def __init__(self, buffer: StepBuffer) -> None:
        self.buffer = buffer

    @property
    @abc.abstractmethod
    def kinds(self) -> frozenset[str]:
        """The histogram kinds hooks sample now."""

    @abc.abstractmethod
    def add(self, item: Recorded) -> None:
        """Keep a hook's record or histogram sample until the step is packed."""

    @abc.abstractmethod
    def sample(self, t: Tensor) -> Tensor:
        """A histogram sample of ``t`` (``sampling.sample``)."""

    @abc.abstractmethod
    def in_backward(self) -> bool:
        """Whether the hook runs inside backward (a checkpoint recompute)."""

    def takes_histogram(self, kind: str) -> bool:
        """Whether this logged step samples tensors of ``kind`` (a tag root) for histograms; output
        gradients also for their log10 histogram, which is derived from the same sample."""
        kinds = self.kinds
        return kind in kinds or (kind == Root.GRADIENT and Root.GRADIENT_LOG10 in kinds)

    def record(
        self, kind: Kind, name: str, t: Tensor, units: int = -1, split: Split | None = None
    ) -> dict[str, Tensor]:
        """Statistics (and a histogram sample over their exact range) of an output, input or
        output gradient (``units``: the dim that holds the module's units; ``split``: how ``t``,
        one rank's piece, is split over ranks); returns the values, by name."""
        named = self.measure(kind, name, t, units, split)
        if self.takes_histogram(kind.name):
            lo: Tensor | None
            hi: Tensor | None
            if "min" in named:  # exact extremes, already taken for the scalars
                lo, hi = named["min"], named["max"]
            elif kind.name in self.kinds:  # the linear histogram's range (log10 rows bin their own)
                lo, hi = torch.aminmax(t)
            else:
                lo = hi = None
            self.add(Sample(kind.name, name, self.sample(t), t.numel(), lo, hi, split=split))
        return named

    def measure(
        self, kind: Kind, name: str, t: Tensor, units: int = -1, split: Split | None = None
    ) -> dict[str, Tensor]:
        """Statistics of ``t`` (as for :meth:`record`) without a histogram sample; returns the values, by name."""
        named = kind.compute(t, units)
        self.add(Record(kind, name, t.numel(), kind.values(named), split=split))
        return named


class Eager(Mode):
    """Hooks run as Python: records go to lists, samples use indices made on the host."""

    compiled = False

    @property
    def kinds(self) -> frozenset[str]:
        return self.buffer.kinds

    def add(self, item: Recorded) -> None:
        buffer = self.buffer
        (buffer._samples if isinstance(item, Sample) else buffer._records).append(item)  # type: ignore[arg-type]

    def sample(self, t: Tensor) -> Tensor:
        return sampling.sample(t, self.buffer.indices)

    def in_backward(self) -> bool:
        return in_backward()


class Traced(Mode):
    """Hooks traced into a compiled graph. Every Python value they read becomes a guard of the
    graph, so they read only objects that stay the same: they sample every kind of the schedule
    on every logged step (``finish`` keeps this step's), append to a :class:`_Sink`, and make
    sample indices with device ops. Compiled forwards are never checkpoint recomputes seen by
    module hooks."""

    compiled = True

    def __init__(self, buffer: StepBuffer, scheduled: frozenset[str]) -> None:
        super().__init__(buffer)
        self._scheduled = scheduled
        self.sink: _Sink[Recorded] = _Sink()

    @property
    def kinds(self) -> frozenset[str]:
        return self._scheduled

    def add(self, item: Recorded) -> None:
        self.sink.append(item)

    def sample(self, t: Tensor) -> Tensor:
        return sampling.traced_sample(t)

    def in_backward(self) -> bool:
        return False


class _Link(Generic[Item]):
    __slots__ = ("item", "prev")

    def __init__(self, item: Item | None, prev: _Link[Item] | None) -> None:
        self.item, self.prev = item, prev


class _Sink(Generic[Item]):
    """What compiled forward hooks append to, instead of a list: dynamo guards a list's length,
    so every further forward of a logged step (gradient accumulation) would compile one more
    graph; of an object attribute it guards only the type. Single-threaded: forwards only."""

    def __init__(self) -> None:
        self._head: _Link[Item] = _Link(None, None)

    def append(self, item: Item) -> None:
        self._head = _Link(item, self._head)

    def drain(self) -> list[Item]:
        """Everything appended, oldest first; empties the sink."""
        items, link = [], self._head
        while link.prev is not None:
            items.append(link.item)
            link = link.prev
        self._head = _Link(None, None)
        return items[::-1]  # type: ignore[return-value]  # every linked item but the sentinel's is set

    def __bool__(self) -> bool:
        return self._head.prev is not None
