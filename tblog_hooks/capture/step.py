"""What the hooks of one logged step record, kept on the device until the step ends, and the one
place that decides how a hook records: eagerly, or traced by ``torch.compile``.

Hooks never read a tensor value on the host: each appends :class:`~tblog_hooks.stats.packing.Record`
objects and histogram :class:`~tblog_hooks.stats.binning.Sample` objects here, and at the end of
the step they are binned and packed into one float64 tensor (``packing.pack_step``). Which of
a closure optimizer's evaluations a step keeps is :class:`OptimizerSteps`'.
"""

from __future__ import annotations

import abc
import enum
import threading
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar, Union, cast

import torch
from torch import Tensor
from torch.optim import Optimizer

from .._compat import TORCH_VERSION, in_backward, in_functorch_transform, step_closure
from ..kernels import Kernels
from ..kernels.outputs import Fused, copied_sample
from ..stats import sampling
from ..stats.binning import Sample
from ..stats.kinds import Computed, Kind
from ..stats.packing import Record
from ..stats.recipe import Recipe, Source
from ..stats.schedule import Histograms
from ..stats.tags import Root, Stat
from ..transport.streams import Streams

if TYPE_CHECKING:
    from ..topology.sharding import Split
    from .watched import Watched


class Part(enum.Enum):
    """A part of the logging that is switched off as a whole when it fails; a watched module's
    own statistics are switched off by its name. Not strings: a module may be named like a part."""

    PARAMETERS = "parameters"
    UPDATE_RATIO = Stat.UPDATE_RATIO.value
    ATTENTION = "attention"
    HISTOGRAMS = "histograms"
    MODULE_STATISTICS = "module statistics"
    LOGITS = "logits= (the log-partition)"
    #: Copying compiled hooks' records out of their CUDA graph's memory.
    COMPILED_RECORDS = "compiled hooks' records"


#: The oldest torch whose ``torch.compile`` the compiled hooks (``Traced``) are tested on.
COMPILE_VERIFIED = (2, 14)
Item = TypeVar("Item")
Recorded = Union[Record, Sample]
_NO_KINDS: frozenset[str] = frozenset()


class StepBuffer:
    """Per-step buffer of device results, fed by the recorders; holds no module or model.
    Hooks may run on several threads (backward on one thread per device): they only append."""

    def __init__(self, histograms: Histograms | None, recipe: Recipe, kernels: Kernels | None = None) -> None:
        #: What hooks record (the logger's recipe).
        self.recipe = recipe
        #: Where the statistics are computed (``TBLOG_HOOKS_KERNELS``, read when the logger was made).
        self.kernels = kernels or Kernels.from_environment()
        self._scalar = recipe[Source.SCALAR]
        #: Whether hooks record now: during a logged step of a logger that is logging.
        self.active = False
        #: Whether this logged step saw training work: a backward that reached the watched modules'
        #: outputs or parameters, or an optimizer step (``close()`` writes a pending step only then).
        self.trained = False
        #: Watched modules and parameters (by name) whose logging failed or ended.
        self.disabled_names: set[str] = set()
        #: Parts of the logging that failed, switched off as a whole.
        self.disabled_parts: set[Part] = set()
        self._old_compile_warned = False
        self._failed: list[tuple[str | Part, BaseException]] = []  # failures of compiled hooks, not yet reported
        self.indices = recipe.indices  # sample and histogram-row indices, made once per size
        self._schedule = histograms
        self.kinds = _NO_KINDS  # histogram kinds of the current logged step
        self._records: list[Record] = []
        self._samples: list[Sample] = []
        self._keeping = threading.Lock()  # backward hooks run on one thread per device
        self.streams = Streams()  # the CUDA streams this logged step's hooks recorded on
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
        no binning; none either once binning failed)."""
        off = self._schedule is None or Part.HISTOGRAMS in self.disabled_parts
        self.kinds = _NO_KINDS if off else self._schedule.kinds_at(index)  # type: ignore[union-attr]
        self.trained = False

    @property
    def empty(self) -> bool:
        """Whether nothing was recorded since the last :meth:`drain`."""
        return not (self._records or self._samples or self.traced.sink)

    def record_scalar(self, key: str, value: Tensor) -> None:
        """A device value logged under the tag ``key`` as it is (the first, if recorded twice)."""
        self._records.append(Record(self._scalar, key, 1, (value,)))

    def append(self, item: Recorded) -> None:
        """Keep an eager hook's record or histogram sample until the step is packed, noting the
        stream its tensor was made on (the step's end waits for it)."""
        if isinstance(item, Sample):
            self.streams.note(item.sample)
            self._samples.append(item)
        else:
            self.streams.note(item.values[0])
            self._records.append(item)

    def stop_histograms(self) -> None:
        """This logged step is packed without histograms (its binning failed); the next ones take
        none either once ``Part.HISTOGRAMS`` is switched off (:meth:`begin`)."""
        self.kinds = _NO_KINDS

    def mark(self) -> Mark:
        """Where the records of this step end now, for :meth:`rewind`."""
        return Mark(len(self._records), len(self._samples), self.traced.sink.mark())

    def rewind(self, mark: Mark) -> None:
        """Drop what the hooks recorded after ``mark`` (a closure optimizer's earlier evaluations);
        nothing is read, no op runs."""
        del self._records[mark.records :]
        del self._samples[mark.samples :]
        self.traced.sink.rewind(mark.traced)

    def keep_traced(self) -> None:
        """Copy what compiled hooks recorded since the last call out of the memory of the graph
        that made it. Under ``torch.compile(mode="reduce-overhead")`` (CUDA graphs) their records
        are outputs of the graph, which its next run (the next micro-batch's forward) overwrites;
        so the eager hooks that run in each backward (the probes', the parameter gradients', else
        ``hooks.KeepTraced``) call this. Eager code only; one copy per recorded tensor, of logged
        steps of compiled models only."""
        with self._keeping:
            try:
                kept = self.traced.sink.keep(_copied)
            except Exception as error:  # (a graph's output overwritten already): the step goes without them
                self.traced.sink.drain()
                self.fail(Part.COMPILED_RECORDS, error)
                return
        for item in kept:  # (the copies are on the stream the backward runs on)
            self.streams.note(item.sample if isinstance(item, Sample) else item.values[0])

    def drain(self) -> tuple[list[Record], list[Sample]]:
        """Everything the hooks recorded this step, in the order they recorded it; empties the buffer."""
        records, samples = self._records, self._samples
        self._records, self._samples = [], []
        failed, self._failed = self._failed, []
        for key, error in failed:
            _warn_failed(key, error)
        traced = self.traced.sink.drain()
        if traced and TORCH_VERSION < COMPILE_VERIFIED and not self._old_compile_warned:
            self._old_compile_warned = True
            warnings.warn(
                f"tblog_hooks: a torch.compile'd model is logged on torch {torch.__version__}; the compiled hooks "
                f"are verified on torch >= {'.'.join(map(str, COMPILE_VERIFIED))} only (on 2.4 and 2.6 records "
                "were missing and graphs recompiled), so check the numbers against an eager step or upgrade torch",
                RuntimeWarning,
                stacklevel=3,
            )
        for item in traced:
            (samples if isinstance(item, Sample) else records).append(item)  # type: ignore[arg-type]
        return records, samples

    def fail(self, key: str | Part, error: BaseException) -> None:
        """Report a failure once and stop logging ``key`` (a module's name, or a part); training
        carries on. A hook traced by ``torch.compile`` only keeps it (a warning there would break
        a ``fullgraph=True`` graph, and end training): it is reported when the step's records are
        drained, outside compiled code."""
        if isinstance(key, Part):
            if key in self.disabled_parts:
                return
            self.disabled_parts.add(key)
        else:
            if key in self.disabled_names:
                return
            self.disabled_names.add(key)
        if torch.compiler.is_compiling():
            self._failed.append((key, error))
        else:
            _warn_failed(key, error)


def _warn_failed(key: str | Part, error: BaseException) -> None:
    name = key.value if isinstance(key, Part) else key
    warnings.warn(
        f"tblog_hooks: logging for {name!r} failed and is switched off: {type(error).__name__}: {error}",
        RuntimeWarning,
        stacklevel=3,
    )


class Mark(NamedTuple):
    """Where a step's records ended at one moment (:meth:`StepBuffer.mark`)."""

    records: int
    samples: int
    traced: object  # (the compiled hooks' sink's newest link)


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
        self,
        kind: Kind,
        name: str,
        t: Tensor,
        units: int = -1,
        split: Split | None = None,
        numerics: Kind | None = None,
    ) -> Computed:
        """Statistics (and a histogram sample over their exact range) of an output, input or
        output gradient (``units``: the dim that holds the module's units; ``split``: how ``t``,
        one rank's piece, is split over ranks), and with ``numerics`` (its ``numerics=`` kind)
        those too, computed together; returns the values, by name."""
        sampled = self.takes_histogram(kind.name)
        named = self.measure(kind, name, t, units, split, numerics, sample=sampled)
        if sampled:
            lo: Tensor | None
            hi: Tensor | None
            at = None
            if isinstance(named, Fused) and (extremes := _extremes(named)) is not None:
                lo = hi = named.buffer  # (the kernels' exact extremes, picked out when binning)
                at = extremes
            elif "min" in named:  # exact extremes, already taken for the scalars
                lo, hi = named["min"], named["max"]
            elif kind.name in self.kinds:  # the linear histogram's range (log10 rows bin their own)
                lo, hi = torch.aminmax(t)
            else:
                lo = hi = None
            copied = copied_sample(named)
            sample = self.sample(t) if copied is None else copied
            self.add(Sample(kind.name, name, sample, t.numel(), lo, hi, split=split, at=at))
        return named

    def measure(
        self,
        kind: Kind,
        name: str,
        t: Tensor,
        units: int = -1,
        split: Split | None = None,
        numerics: Kind | None = None,
        sample: bool = False,
    ) -> Computed:
        """Statistics of ``t`` (as for :meth:`record`); returns the values, by name, and where the
        kernels take ``t``, with ``sample`` its histogram sample too (``Fused.sample``)."""
        kinds = (kind,) if numerics is None else (kind, numerics)
        named = self.buffer.kernels.compute(kinds, t, units, sample)
        for each in kinds:
            self.add(Record.of(each, name, t.numel(), named, split=split))
        return named


def _extremes(named: Fused) -> int | None:
    """Where the kernels' exact min lies in their buffer, the max just after it; ``None`` if not there."""
    lo, hi = named.in_buffer("min"), named.in_buffer("max")
    return lo[0] if lo is not None and hi is not None and hi[0] == lo[0] + 1 else None


class Eager(Mode):
    """Hooks run as Python: records go to lists, samples use indices made on the host."""

    compiled = False

    @property
    def kinds(self) -> frozenset[str]:
        return self.buffer.kinds

    def add(self, item: Recorded) -> None:
        self.buffer.append(item)

    def sample(self, t: Tensor) -> Tensor:
        return sampling.sample(t, self.buffer.indices)

    def samples(self, tensors: list[Tensor]) -> list[Tensor]:
        """Histogram samples of several tensors (a step's parameters or their gradients): where
        the kernels take them, copied with one launch (``Kernels.samples``)."""
        return self.buffer.kernels.samples(tensors, self.sample)

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


def _copied(items: list[Recorded]) -> list[Recorded]:
    """``items`` holding copies of their tensors."""
    out: list[Recorded] = []
    for item in items:
        if isinstance(item, Record):
            out.append(item._replace(values=tuple(t.clone() for t in item.values)))
        else:
            lo, hi, weight = (None if t is None else t.clone() for t in (item.lo, item.hi, item.weight))
            out.append(item._replace(sample=item.sample.clone(), lo=lo, hi=hi, weight=weight))
    return out


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
        self._kept = self._head  # the newest link :meth:`keep` saw (never read by traced code)

    def append(self, item: Item) -> None:
        self._head = _Link(item, self._head)

    def mark(self) -> _Link[Item]:
        """The newest link, for :meth:`rewind`."""
        return self._head

    def rewind(self, mark: object) -> None:
        """Unlink what was appended after ``mark`` (a link :meth:`mark` returned since the last
        :meth:`drain`; any other leaves the sink as it is)."""
        link, kept = self._head, False
        while link is not mark and link.prev is not None:
            kept |= link is self._kept
            link = link.prev
        if link is mark:
            self._head = link
            if kept:  # keep() had copied past the mark: every link up to it is kept
                self._kept = link

    def keep(self, copy: Callable[[list[Item]], list[Item]]) -> list[Item]:
        """Replace the items appended since the last call by their ``copy``; returns the copies."""
        links, link = [], self._head
        while link is not self._kept and link.prev is not None:
            links.append(link)
            link = link.prev
        copies = copy([link.item for link in links]) if links else []  # type: ignore[misc]
        for link, item in zip(links, copies):
            link.item = item
        self._kept = self._head
        return copies

    def drain(self) -> list[Item]:
        """Everything appended, oldest first; empties the sink."""
        items, link = [], self._head
        while link.prev is not None:
            items.append(link.item)
            link = link.prev
        self._head = self._kept = _Link(None, None)
        return items[::-1]  # type: ignore[return-value]  # every linked item but the sentinel's is set

    def __bool__(self) -> bool:
        return self._head.prev is not None


#: Drops what the hooks recorded after it was made (``Recording.rewinder``).
Rewind = Callable[[], None]


class OptimizerSteps:
    """A logger's optimizer step pre-hook (:meth:`pre`; ``register_optimizer_step_pre_hook``: every
    ``torch.optim`` optimizer), and what it saw this logged step: a closure optimizer's evaluations,
    and a ``step()`` the loop forgot.

    - An optimizer given a closure (``LBFGS``, Lightning's ``optimizer.step(closure)``) may call it
      several times; each call is one evaluation of the loss, not a micro-batch, so the step's
      statistics are the last evaluation's (as its parameter gradients are): the hook hands the
      optimizer the closure wrapped so that each call first drops what the hooks recorded since the
      step began (a few list truncations; nothing read, no op), and sets back what
      :attr:`every_step` holds, on any step.
    - An optimizer that steps twice in a logged step says that ``step()`` was not called after its
      first step (gradient accumulation is one optimizer step; a GAN's two optimizers step once
      each), said once.

    On a step that is not logged, a step without a closure returns at once.
    """

    def __init__(self, buffer: StepBuffer, watched: Watched, rewinder: Callable[[], Rewind]) -> None:
        """``rewinder``: makes a :data:`Rewind` of the records made so far (``Recording.rewinder``)."""
        self.buffer, self.watched, self._rewinder = buffer, watched, rewinder
        self._steps: dict[int, int] = {}  # id(optimizer) -> its steps this logged step
        self._closure: Rewind | None = None  # of the closure step under way, if any
        self._warned = False
        #: What else a closure's evaluation starts again, on every step, logged or not (each makes
        #: a :data:`Rewind` of its state as the step begins): ``spikes=``' sample count.
        self.every_step: list[Callable[[], Rewind]] = []

    def pre(self, optimizer: Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Optimizer step pre-hook: count the step; given a closure, return the step's arguments
        with the closure wrapped (see the module's docstring), else ``None`` (arguments unchanged)."""
        buffer = self.buffer
        if buffer.active:
            buffer.trained = True
            self._count(optimizer)
        given = step_closure(args, kwargs)
        if given is None or not (buffer.active or self.every_step):
            return None
        closure = cast(Callable[..., Any], given)
        rewinds = [make() for make in self.every_step]
        if buffer.active:
            rewind = self._closure = self._rewinder()
            rewinds.append(lambda: rewind() if self._closure is rewind else None)  # (not once the logged step ended)

        def evaluation(*a: Any, **k: Any) -> Any:
            for start_again in rewinds:
                start_again()
            return closure(*a, **k)

        if "closure" in kwargs:
            return args, {**kwargs, "closure": evaluation}
        return (*args[:1], evaluation, *args[2:]), kwargs

    def _count(self, optimizer: Optimizer) -> None:
        """One more step of ``optimizer`` in this logged step; its second is said (once)."""
        steps = self._steps[id(optimizer)] = self._steps.get(id(optimizer), 0) + 1
        if steps == 2 and not self._warned and self._trains_watched(optimizer):
            self._warned = True
            warnings.warn(
                f"tblog_hooks: {type(optimizer).__name__} stepped a second time within one logged step, so that logged "
                "step pools the statistics of every optimizer step since the last hooks.step(); call hooks.step() "
                "once after each optimizer step (after all of the step's micro-batches, with gradient accumulation)",
                RuntimeWarning,
                stacklevel=4,
            )

    def end_step(self) -> None:
        """The logged step ended: forget its optimizer steps."""
        self._steps.clear()
        self._closure = None

    def _trains_watched(self, optimizer: Optimizer) -> bool:
        """Whether ``optimizer`` steps a parameter of the watched modules (another model's
        optimizer may step as often as it likes)."""
        watched = {id(p) for _, p in self.watched.params()}
        return any(id(p) in watched for group in optimizer.param_groups for p in group["params"])
