"""What the hooks record during one logged step, kept on the device until the step ends.

The hooks (see ``hooks.py``) call into a :class:`Collector`. It never reads a tensor value
on the host: each hook appends :class:`~tblog_hooks.records.Record` objects and histogram
samples, and :meth:`Collector.finish` bins the histograms and packs everything into one
float64 tensor plus the :class:`~tblog_hooks.records.Layout` that says what each number is.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional, TypeVar

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from . import pictures, stats
from .distributed import is_sharded, local_shard
from .histograms import Histograms
from .passes import PassFilter
from .records import (
    ACTIVATION,
    COUNT,
    GRADIENT,
    GRADIENT_LOG10,
    HISTOGRAM,
    IMAGE,
    INPUT,
    PARAM,
    PARAM_GRAD,
    SCALAR,
    HistMeta,
    Kind,
    Layout,
    Record,
    pack,
)  # fmt: skip
from .tags import tag


@dataclass(frozen=True)
class Options:
    activations: bool = True
    gradients: bool = True
    parameters: bool = True
    histograms: Histograms | None = Histograms()  # noqa: RUF009 (immutable)
    eval_passes: bool = False
    inputs: bool = False
    feature_maps: frozenset[str] = frozenset()


class HistRow(NamedTuple):
    """A histogram sample of one tensor, with the tensor's exact extremes where known."""

    kind: str  # tag root: activation, input, gradient, param, param_grad
    name: str
    sample: Tensor
    numel: int  # elements of the tensor
    lo: Tensor | None
    hi: Tensor | None


class Collector:
    """Per-step buffer of device results, fed by the hooks; holds no module or model.
    Hooks may run on several threads (backward on one thread per device): they only append."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.active = False
        self._hist_kinds = _NO_KINDS  # histogram kinds of the current logged step
        self.passes = PassFilter(eval_passes=options.eval_passes)
        self.disabled: set[str] = set()
        self._records: list[Record] = []
        self._hists: list[HistRow] = []
        self._tensor_handles: list[RemovableHandle] = []
        self._before_update: tuple[list[tuple[str, Tensor]], list[Tensor], list[Tensor]] | None = None
        # The latest activation recorded: (weakref to it, its version, its NaN/Inf count).
        self._last_output: tuple[weakref.ref[Tensor], int, Tensor] | None = None
        self._mapped: set[str] = set()  # feature maps taken this step
        # Parameters whose gradient was read this step: its record and histogram sample.
        self._graded: dict[str, tuple[Record, HistRow | None]] = {}
        self.forward_order: list[str] = []  # watched modules in the order their forward hooks first fired
        self._fired: set[str] = set()

    @property
    def empty(self) -> bool:
        """Whether nothing was recorded since the last :meth:`finish`."""
        return not (self._records or self._hists or self._graded)

    def begin(self, index: int) -> None:
        """A logged step begins; ``index`` is its number in logged steps (``step // every``),
        which picks the histograms it takes (none: no sampling, no binning)."""
        schedule = self.options.histograms
        self._hist_kinds = _NO_KINDS if schedule is None else schedule.kinds_at(index)

    # -- called from hooks ---------------------------------------------------------------
    def on_output(self, name: str, output: object, training: bool) -> None:
        """Forward hook body: statistics of the output now, a gradient hook for later
        (of training passes only, see ``passes.py``)."""
        if name in self.disabled:
            return
        if name not in self._fired and not torch.compiler.is_compiling():
            # Not while compiling: a set that grows would be one more guard and one more graph.
            self._fired.add(name)
            self.forward_order.append(name)
        try:
            counted = self.passes.classify(name, training)
            if not any(counted):
                return
            tensors = _loggable_leaves(output)
            if not tensors:
                return
            with torch.no_grad():
                if name in self.options.feature_maps and name not in self._mapped:
                    self._add_feature_map(name, tensors)
                if self.options.activations and counted.activations:
                    for t in tensors:
                        values = self._record(ACTIVATION, name, t)
                        if not torch.compiler.is_compiling() and not t.is_inference():  # (no weakref, no version)
                            # Read by the next module's pre-hook if its input is this very tensor.
                            self._last_output = (weakref.ref(t), t._version, values[_NONFINITE])
            if self.options.gradients and counted.gradients:
                for t in tensors:
                    if t.requires_grad:
                        self._watch_gradient(name, t)
        except Exception as error:  # the logger must never stop training
            self.fail(name, error)

    def on_input(self, name: str, inputs: object, training: bool) -> None:
        """Forward pre-hook body: the inputs' non-finite count (to tell where NaN/Inf start),
        or with ``inputs=True`` the same statistics as for outputs."""
        if name in self.disabled or not (self.options.activations or self.options.inputs):
            return  # without output counts the input count tells nothing
        if not self.passes.records_inputs(name, training):
            return
        try:
            with torch.no_grad():
                for t in _loggable_leaves(inputs):
                    if self.options.inputs:
                        self._record(INPUT, name, t)
                    else:
                        count = self._nonfinite_input(t)
                        self._records.append(Record(COUNT, tag(INPUT.name, "nonfinite", name), 1, (count,)))
        except Exception as error:
            self.fail(name, error)

    def on_output_grad(self, name: str, grad: Tensor) -> None:
        if name in self.disabled:
            return
        try:
            if not stats.loggable(grad):
                return
            with torch.no_grad():
                norm, bad, lo, hi = stats.gradient_stats(grad)
                self._records.append(Record(GRADIENT, name, grad.numel(), (norm, bad)))
                if self._takes_histogram(GRADIENT.name):
                    self._hists.append(HistRow(GRADIENT.name, name, stats.sample(grad), grad.numel(), lo, hi))
        except Exception as error:
            self.fail(name, error)

    def on_params(self, named: list[tuple[str, Tensor]]) -> None:
        """Record gradient norms (and histograms) of parameters whose ``.grad`` is final."""
        try:
            named = [(key, p) for key, p in named if key not in self.disabled and stats.loggable(p.grad)]
            if not named:
                return
            with torch.no_grad():
                grads = [local_shard(p.grad) for _, p in named]  # type: ignore[arg-type]  # loggable: not None
                keys = [key for key, _ in named]
                samples = self._samples(PARAM_GRAD.name, keys, grads) if self.options.histograms else {}
                # A later read (the next micro-batch's accumulated gradient) replaces an earlier one.
                for key, grad, norm in zip(keys, grads, stats.norms(grads)):
                    self._graded[key] = (Record(PARAM_GRAD, key, grad.numel(), (norm,)), samples.get(key))
        except Exception as error:
            self.fail(named[0][0] if len(named) == 1 else "parameters", error)
            self.disabled.update(key for key, _ in named)

    def on_weights(self, named: list[tuple[str, Tensor]]) -> None:
        """Histograms of the weights whose gradients this step recorded, as they are at the end
        of the step (after the update); all in a few ops, not a few per parameter."""
        named = [(key, p) for key, p in named if key in self._graded]
        if not named or not self.options.histograms:
            return
        try:
            with torch.no_grad():
                samples = self._samples(PARAM, [key for key, _ in named], [local_shard(p) for _, p in named])
                self._hists += samples.values()
        except Exception as error:
            self.fail("parameters", error)

    def before_update(self, named: list[tuple[str, Tensor]]) -> None:
        """Optimizer step pre-hook: copy the weights (logged steps only) to measure the update.
        FSDP2-sharded weights are left out: a shard's ratio is not the parameter's."""
        named = [(key, p) for key, p in named if not is_sharded(p)]
        if not named:
            return
        try:
            with torch.no_grad():
                weights = [p.detach() for _, p in named]
                self._before_update = (named, stats.norms(weights), list(torch._foreach_mul(weights, 1.0)))
        except Exception as error:
            self.fail("update_ratio", error)

    def after_update(self) -> None:
        """Optimizer step post-hook: ``||W_after - W_before|| / ||W_before||`` per parameter,
        computed in place in the copy, which is then dropped."""
        if self._before_update is None:
            return
        named, norms, before = self._before_update
        self._before_update = None
        try:
            with torch.no_grad():
                torch._foreach_sub_(before, [p.detach() for _, p in named])
                for (key, _), ratio in zip(named, torch._foreach_div(stats.norms(before), norms)):
                    self.record_scalar(tag(PARAM, "update_ratio", key), ratio)
        except Exception as error:
            self.fail("update_ratio", error)

    def record_scalar(self, key: str, value: Tensor) -> None:
        """A device value logged under ``key`` as it is (the first, if recorded twice)."""
        self._records.append(Record(SCALAR, key, 1, (value,)))

    # -- bookkeeping -----------------------------------------------------------------------
    def _takes_histogram(self, kind: str) -> bool:
        """Whether this logged step samples tensors of ``kind`` (a tag root) for histograms; output
        gradients also for their log10 histogram, which is derived from the same sample."""
        return kind in self._hist_kinds or (kind == GRADIENT.name and GRADIENT_LOG10 in self._hist_kinds)

    def _record(self, kind: Kind, name: str, t: Tensor) -> tuple[Tensor, ...]:
        """Statistics (and a histogram sample) of an output or input; returns the values."""
        values = stats.tensor_stats(t)
        self._records.append(Record(kind, name, t.numel(), values))
        if self._takes_histogram(kind.name):
            self._hists.append(HistRow(kind.name, name, stats.sample(t), t.numel(), values[_MIN], values[_MAX]))
        return values

    def _samples(self, kind: str, keys: list[str], tensors: list[Tensor]) -> dict[str, HistRow]:
        """Histogram samples of parameters or their gradients (empty FSDP2 shards have none);
        none on a step that does not histogram ``kind``."""
        keep = [i for i, t in enumerate(tensors) if t.numel() and self._takes_histogram(kind)]
        lows, highs = stats.extremes([tensors[i] for i in keep])
        return {
            keys[i]: HistRow(kind, keys[i], stats.sample(tensors[i]), tensors[i].numel(), lo, hi)
            for i, lo, hi in zip(keep, lows, highs)
        }

    def _nonfinite_input(self, t: Tensor) -> Tensor:
        """NaN/Inf count of an input; reused when the input is the unchanged output of the
        watched module that ran just before (conv -> bn in a ResNet), saving a pass over it."""
        last = self._last_output
        if last is not None and last[0]() is t and not t.is_inference() and t._version == last[1]:
            return last[2]
        return stats.nonfinite(t)

    def _watch_gradient(self, name: str, t: Tensor) -> None:
        # Inside torch.compile a hook that writes to the collector breaks the graph at every
        # module (dynamo cannot trace the mutation, and a disabled hook is a break too), so
        # compiled forwards record activations and leave output gradients out.
        if not torch.compiler.is_compiling():
            self._tensor_handles.append(t.register_hook(_GradientHook(self, name)))

    def _add_feature_map(self, name: str, tensors: list[Tensor]) -> None:
        """Channels of the first sample of the first 3-D-or-more output, first call only."""
        maps = [t for t in tensors if t.dim() >= 3]
        if maps:
            self._mapped.add(name)
            grid = pictures.feature_grid(maps[0][0])
            self._records.append(Record(IMAGE, tag("feature_map", name), grid.numel(), (grid,), tuple(grid.shape)))

    def fail(self, name: str, error: BaseException) -> None:
        """Report a failure once and stop logging ``name``; training carries on."""
        if name not in self.disabled:
            self.disabled.add(name)
            warnings.warn(
                f"tblog_hooks: logging for {name!r} failed and is switched off: {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=2,
            )

    def remove_tensor_hooks(self) -> None:
        for handle in self._tensor_handles:
            handle.remove()
        self._tensor_handles.clear()

    def finish(self) -> tuple[Tensor, Layout] | None:
        """Bin this step's histograms and pack every record into one float64 tensor; reset."""
        self.remove_tensor_hooks()
        records, hists = self._records, self._hists
        for record, row in self._graded.values():
            records.append(record)
            if row is not None:
                hists.append(row)
        self._records, self._hists, self._before_update, self._last_output = [], [], None, None
        self._mapped, self._graded = set(), {}
        if not records and not hists:
            return None
        device = (records[0].values[0] if records else hists[0].sample).device
        rows: list[HistMeta] = []
        if hists:
            binned, rows = _histograms(hists, device, self._hist_kinds)
            records.append(Record(HISTOGRAM, "", binned.numel(), (binned,), (len(rows), stats.HIST_WIDTH)))
        packed, layout = pack(records, device)
        layout.hists = rows
        return packed, layout


_NO_KINDS: frozenset[str] = frozenset()
#: Positions of the min, max and non-finite count in ``stats.tensor_stats``'s values.
_MIN, _MAX, _NONFINITE = 2, 3, 5


def _histograms(hists: list[HistRow], device: torch.device, kinds: frozenset[str]) -> tuple[Tensor, list[HistMeta]]:
    """Every histogram of the step binned at once (``stats.histograms`` rows, flattened), and
    what each row is; the log10 histograms of the output gradients are derived here (the
    gradients' own rows are kept if ``kinds`` holds them)."""
    gradients = [h for h in hists if h.kind == GRADIENT.name]
    rows = [h for h in hists if h.kind != GRADIENT.name or GRADIENT.name in kinds]
    samples = _on(device, [h.sample for h in rows])
    if gradients and GRADIENT_LOG10 in kinds:
        # Zeros become -inf and, like NaN/Inf, stay out of the histogram.
        logs = torch.cat(_on(device, [h.sample for h in gradients])).float().abs_().log10_()
        samples += list(logs.split([h.sample.numel() for h in gradients]))
        rows += [HistRow(GRADIENT_LOG10, h.name, h.sample, h.numel, None, None) for h in gradients]
    keys: dict[tuple[str, str], int] = {}
    index = [keys.setdefault((h.kind, h.name), len(keys)) for h in rows]
    binned = stats.histograms(samples, _on(device, [h.lo for h in rows]), _on(device, [h.hi for h in rows]), index)
    return binned.reshape(-1), [HistMeta(h.kind, h.name, h.numel, h.sample.numel()) for h in rows]


T = TypeVar("T", Tensor, Optional[Tensor])


def _on(device: torch.device, tensors: list[T]) -> list[T]:
    """Results of a model spread over several devices, moved to one (a no-op on one device)."""
    return [t if t is None or t.device == device else t.to(device, non_blocking=True) for t in tensors]


def _loggable_leaves(tree: object) -> list[Tensor]:
    """The tensors of a (nested) input or output that statistics are taken of."""
    leaves = [tree] if isinstance(tree, Tensor) else tree_flatten(tree)[0]
    return [t for t in leaves if stats.loggable(t)]


class _GradientHook:
    """Tensor hook on a module output: records the gradient, never changes it."""

    __slots__ = ("collector", "name")

    def __init__(self, collector: Collector, name: str) -> None:
        self.collector, self.name = collector, name

    def __call__(self, grad: Tensor) -> None:
        self.collector.on_output_grad(self.name, grad)
