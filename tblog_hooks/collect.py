"""What the hooks record during one logged step, kept on the device until the step ends.

The hooks (see ``hooks.py``) call into a :class:`Collector`. It never reads a tensor value
on the host: each hook appends :class:`~tblog_hooks.records.Record` objects and histogram
samples, and :meth:`Collector.finish` bins the histograms and packs everything into one
float64 tensor plus the :class:`~tblog_hooks.records.Layout` that says what each number is.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, NamedTuple, Optional, TypeVar

import torch
from torch import Tensor, nn
from torch.autograd.variable import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.hooks import RemovableHandle

from . import pictures, probes, stats
from .distributed import is_sharded, local_shard
from .histograms import Histograms
from .passes import PassFilter
from .records import (
    ACTIVATION,
    GRADIENT,
    GRADIENT_LOG10,
    HISTOGRAM,
    IMAGE,
    INPUT,
    NONFINITE,
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
    #: Elements each sampled one stands for, where only the device knows (``probes.histogram``):
    #: then ``numel`` is the sample's length and the counts are scaled on the device.
    weight: Tensor | None = None


class Collector:
    """Per-step buffer of device results, fed by the hooks; holds no module or model.
    Hooks may run on several threads (backward on one thread per device): they only append."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.active = False
        self._hist_kinds = _NO_KINDS  # histogram kinds of the current logged step
        self._scheduled_kinds = _NO_KINDS if options.histograms is None else options.histograms.all_kinds
        self.passes = PassFilter(eval_passes=options.eval_passes)
        self.disabled: set[str] = set()
        self._records: list[Record] = []
        self._hists: list[HistRow] = []
        self._traced: _Sink[Record | HistRow] = _Sink()  # what compiled forward hooks recorded
        self._tensor_handles: list[RemovableHandle] = []
        self._before_update: tuple[list[tuple[str, Tensor]], list[Tensor], list[Tensor]] | None = None
        # The latest activation recorded: (weakref to it, its version, its finite count).
        self._last_output: tuple[weakref.ref[Tensor], int, Tensor] | None = None
        self._mapped: set[str] = set()  # feature maps taken this step
        # Parameters whose gradient was read this step: its record and histogram sample.
        self._graded: dict[str, tuple[Record, HistRow | None]] = {}
        self._ready: list[tuple[str, Tensor]] = []  # parameters whose gradient this backward made final
        self._indices = stats.IndexCache()  # sample and histogram-row indices, made once per size
        self.forward_order: list[str] = []  # watched modules in the order their forward hooks first fired
        self._fired: set[str] = set()
        self._probes: dict[str, probes.Probe] = {}  # output gradients under torch.compile
        self._warned_repeated = False

    def place_probes(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        """A probe per watched module, on the device its outputs will be on: made now, before
        ``torch.compile`` traces the hooks (one made later would be one more graph)."""
        if self.options.gradients:
            for name, module in modules.items():
                self._place_probe(name, probes.home_device(module, model))

    def _place_probe(self, name: str, device: torch.device) -> None:
        width = stats.SAMPLE_CAP if self.options.histograms else 0
        # A weak reference: the probe's tensor hook must not keep the collector alive.
        self._probes[name] = probes.Probe(device, width, functools.partial(_on_probe, weakref.ref(self), name))

    def _move_probes(self, records: list[Record]) -> None:
        """Probes of modules whose outputs turned out to be on another device (the model was
        moved after the logger was made) follow them, at the cost of one more graph."""
        for record in records:
            probe = self._probes.get(record.name)
            if record.kind is ACTIVATION and probe is not None and probe.device != record.values[0].device:
                self._place_probe(record.name, record.values[0].device)

    @property
    def empty(self) -> bool:
        """Whether nothing was recorded since the last :meth:`finish`."""
        return not (self._records or self._hists or self._graded or self._traced)

    def begin(self, index: int) -> None:
        """A logged step begins; ``index`` is its number in logged steps (``step // every``),
        which picks the histograms it takes (none: no sampling, no binning)."""
        schedule = self.options.histograms
        self._hist_kinds = _NO_KINDS if schedule is None else schedule.kinds_at(index)

    # -- called from hooks ---------------------------------------------------------------
    def on_output(self, name: str, output: object, training: bool) -> object | None:
        """Forward hook body: statistics of the output now, a gradient hook for later
        (of training passes only, see ``passes.py``). Under ``torch.compile``, returns the
        output passed through the module's probe instead (``probes.py``)."""
        if name in self.disabled:
            return None
        if name not in self._fired and not torch.compiler.is_compiling():
            # Not while compiling: a set that grows would be one more guard and one more graph.
            self._fired.add(name)
            self.forward_order.append(name)
        try:
            counted = self.passes.classify(name, training)
            if not any(counted):
                return None
            tensors = _loggable_leaves(output)
            if not tensors:
                return None
            with torch.no_grad():
                if name in self.options.feature_maps and name not in self._mapped:
                    self._add_feature_map(name, tensors)
                if self.options.activations and counted.activations:
                    for t in tensors:
                        values = self._record(ACTIVATION, name, t)
                        if not torch.compiler.is_compiling() and not t.is_inference():  # (no weakref, no version)
                            # Read by the next module's pre-hook if its input is this very tensor.
                            self._last_output = (weakref.ref(t), t._version, ACTIVATION.value(values, "finite"))
            if self.options.gradients and counted.gradients:
                if torch.compiler.is_compiling():
                    return self._tap(name, output)
                for t in tensors:
                    if t.requires_grad:
                        self._tensor_handles.append(t.register_hook(_GradientHook(self, name)))
        except Exception as error:  # the logger must never stop training
            self.fail(name, error)
        return None

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
                        finite = self._finite_input(t)
                        self._add(Record(NONFINITE, tag(INPUT.name, "nonfinite", name), t.numel(), (finite,)))
        except Exception as error:
            self.fail(name, error)

    def on_output_grad(self, name: str, grad: Tensor) -> None:
        if name in self.disabled:
            return
        try:
            if not stats.loggable(grad):
                return
            with torch.no_grad():
                self._record(GRADIENT, name, grad)
        except Exception as error:
            self.fail(name, error)

    def on_probe(self, name: str, summed: Tensor) -> None:
        """A probe's gradient: the summary of one backward through the module (``probes.py``)."""
        if name in self.disabled or not self.active:  # a backward after its logged step ended
            return
        try:
            with torch.no_grad():
                # Elements are on the device only; GRADIENT's fields pool without them.
                self._records.append(Record(GRADIENT, name, 0, probes.gradient(summed)))
                if self._takes_histogram(GRADIENT.name):
                    sample, lo, hi, weight = probes.histogram(summed)
                    self._hists.append(HistRow(GRADIENT.name, name, sample, sample.numel(), lo, hi, weight))
        except Exception as error:
            self.fail(name, error)

    def repeated_backward(self, name: str) -> None:
        """A second backward reached the same output (``retain_graph=True``); said once."""
        if not self._warned_repeated:
            self._warned_repeated = True
            warnings.warn(
                f"tblog_hooks: a second backward pass reached an output of {name!r} in one step (retain_graph=True): "
                "gradient/norm pools the passes' gradients as separate ones (the root of their summed squares), "
                "not as the norm of their sum, which is what reached the output; keeping each gradient until "
                "the next one arrives would cost the memory of every watched output",
                RuntimeWarning,
                stacklevel=2,
            )

    def on_param_grad(self, name: str, param: Tensor) -> None:
        """Post-accumulate-grad hook body: ``param.grad`` is final for this backward. Read when
        the backward ends, with every other parameter it reached: one norm op for all of them.
        Each call queues the reading (the first callback reads them all): one queued only by the
        first would be lost with a backward that raises, and the next backward's with it."""
        self._ready.append((name, param))
        try:
            Variable._execution_engine.queue_callback(self._read_ready)
        except RuntimeError:  # not run by the autograd engine: read it now
            self._read_ready()

    def _read_ready(self) -> None:
        ready, self._ready = self._ready, []
        if ready:
            self.on_params(ready)

    def on_params(self, named: list[tuple[str, Tensor]], scale: Tensor | None = None) -> None:
        """Record gradient norms (and histograms) of parameters whose ``.grad`` is final; divided
        on the device by ``scale``, the loss scale still in ``.grad`` (see ``amp.grad_scale``)."""
        try:
            with torch.no_grad():  # (a gradient of create_graph=True backward requires grad)
                graded = [(key, g) for key, p in named if key not in self.disabled and (g := _gradient(p.grad))]
                if not graded:
                    return
                keys = [key for key, _ in graded]
                grads = [g for _, (g, _) in graded]
                shown = [h for _, (_, h) in graded]
                samples = self._samples(PARAM_GRAD.name, keys, shown)
                norms = stats.norms(grads)
                if scale is not None:  # a fused optimizer's gradients, still scaled: unscaled here
                    divisor = scale.to(norms[0].device).reshape(())
                    norms = list(torch._foreach_div(norms, divisor))
                    for row in samples.values():
                        row.sample.div_(divisor)
                # A later read (the next micro-batch's accumulated gradient) replaces an earlier one.
                for key, grad, norm in zip(keys, grads, norms):
                    self._graded[key] = (Record(PARAM_GRAD, key, grad.numel(), (norm,)), samples.get(key))
        except Exception as error:
            self.fail(named[0][0] if len(named) == 1 else "parameters", error)
            self.disabled.update(key for key, _ in named)

    def on_weights(self, params: Callable[[], list[tuple[str, Tensor]]]) -> None:
        """Histograms of the weights whose gradients this step recorded, as they are at the end
        of the step (after the update). ``params`` looks the watched parameters up: called only
        on a step that takes weight histograms."""
        if not self._graded or not self._takes_histogram(PARAM):
            return
        named = [(key, p) for key, p in params() if key in self._graded]
        if not named:
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
                weights = [p for _, p in named]
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
                torch._foreach_sub_(before, [p for _, p in named])
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
        kinds = self._kinds()
        return kind in kinds or (kind == GRADIENT.name and GRADIENT_LOG10 in kinds)

    def _kinds(self) -> frozenset[str]:
        """The histogram kinds hooks sample now. Compiled hooks sample every kind of the schedule
        on every logged step (finish keeps this step's): a different set per step would be a
        guard, and one more graph."""
        return self._scheduled_kinds if torch.compiler.is_compiling() else self._hist_kinds

    def _record(self, kind: Kind, name: str, t: Tensor) -> tuple[Tensor, ...]:
        """Statistics (and a histogram sample over their exact range) of an output, input or
        output gradient; returns the values."""
        values = kind.compute(t)  # type: ignore[misc]  # kinds recorded from tensors have one
        self._add(Record(kind, name, t.numel(), values))
        if self._takes_histogram(kind.name):
            lo: Tensor | None
            hi: Tensor | None
            if kind.has("min"):  # exact extremes, already taken for the scalars
                lo, hi = kind.value(values, "min"), kind.value(values, "max")
            elif kind.name in self._kinds():  # the linear histogram's range (log10 rows bin their own)
                lo, hi = torch.aminmax(t)
            else:
                lo = hi = None
            self._add(HistRow(kind.name, name, stats.sample(t, self._indices), t.numel(), lo, hi))
        return values

    def _add(self, item: Record | HistRow) -> None:
        """A hook's record or histogram sample."""
        if torch.compiler.is_compiling():
            self._traced.append(item)
        elif isinstance(item, HistRow):
            self._hists.append(item)
        else:
            self._records.append(item)

    def _samples(self, kind: str, keys: list[str], tensors: list[Tensor]) -> dict[str, HistRow]:
        """Histogram samples of parameters or their gradients, over the sample's own range (no
        pass over the whole tensor); empty FSDP2 shards have none, nor a step without ``kind``."""
        if not self._takes_histogram(kind):
            return {}
        return {
            key: HistRow(kind, key, stats.sample(t, self._indices), t.numel(), None, None)
            for key, t in zip(keys, tensors)
            if t.numel()
        }

    def _finite_input(self, t: Tensor) -> Tensor:
        """Finite count of an input (for its NaN/Inf count); reused when the input is the
        unchanged output of the watched module that ran just before (conv -> bn in a ResNet),
        saving a pass over it."""
        last = None if torch.compiler.is_compiling() else self._last_output  # is_inference() breaks a graph
        if last is not None and last[0]() is t and not t.is_inference() and t._version == last[1]:
            return last[2]
        return stats.finite(t)

    def _tap(self, name: str, output: object) -> object | None:
        """The output with each tensor that carries a gradient passed through the module's
        probe, or ``None`` (keep the output) if there is none: a tensor hook that writes into
        the collector would break the compiled graph at every module."""
        probe = self._probes.get(name)
        if probe is None:
            return None
        leaves, spec = tree_flatten(output)
        tapped = [
            probe.tap(t) if stats.loggable(t) and t.requires_grad and t.device == probe.device else t for t in leaves
        ]
        if all(a is b for a, b in zip(tapped, leaves)):
            return None
        replaced: object = tree_unflatten(tapped, spec)
        return replaced

    def _add_feature_map(self, name: str, tensors: list[Tensor]) -> None:
        """Channels of the first sample of the first 3-D-or-more output, first call only."""
        maps = [t for t in tensors if t.dim() >= 3]
        if maps:
            self._mapped.add(name)
            grid = pictures.feature_grid(maps[0][0])
            self._add(Record(IMAGE, tag("feature_map", name), grid.numel(), (grid,), tuple(grid.shape)))

    def fail(self, name: str, error: BaseException) -> None:
        """Report a failure once and stop logging ``name``; training carries on."""
        if name not in self.disabled:
            self.disabled.add(name)
            warnings.warn(
                f"tblog_hooks: logging for {name!r} failed and is switched off: {type(error).__name__}: {error}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _unhook_outputs(self) -> None:
        for handle in self._tensor_handles:
            handle.remove()
        self._tensor_handles.clear()

    def release(self) -> None:
        """The logger is done: stop recording, remove every gradient hook (the probes' too),
        drop cached tensors."""
        self.active = False
        self._unhook_outputs()
        self._probes.clear()
        self._indices.clear()

    def finish(self) -> tuple[Tensor, Layout] | None:
        """Bin this step's histograms and pack every record into one float64 tensor; reset."""
        self._unhook_outputs()
        records, hists = self._records, self._hists
        for item in self._traced.drain():
            if isinstance(item, HistRow):
                hists.append(item)
            else:
                records.append(item)
        self._move_probes(records)
        for record, row in self._graded.values():
            records.append(record)
            if row is not None:
                hists.append(row)
        self._records, self._hists, self._before_update, self._last_output = [], [], None, None
        self._ready = []  # of a backward that raised before its end
        self._mapped, self._graded = set(), {}
        if not records and not hists:
            return None
        device = (records[0].values[0] if records else hists[0].sample).device
        binned, rows = _histograms(hists, device, self._hist_kinds, self._indices)
        if rows:
            records.append(Record(HISTOGRAM, "", binned.numel(), (binned,), (len(rows), stats.HIST_WIDTH)))
        if not records:
            return None
        packed, layout = pack(records, device)
        layout.hists = rows
        return packed, layout


_NO_KINDS: frozenset[str] = frozenset()


def _histograms(
    hists: list[HistRow], device: torch.device, kinds: frozenset[str], cache: stats.IndexCache
) -> tuple[Tensor, list[HistMeta]]:
    """Every histogram of the step binned at once (``stats.histograms`` rows, flattened), and
    what each row is; the log10 histograms of the output gradients are derived here (the
    gradients' own rows are kept if ``kinds`` holds them)."""
    gradients = [h for h in hists if h.kind == GRADIENT.name]
    rows = [h for h in hists if h.kind in kinds]  # (compiled hooks sample every scheduled kind)
    if not rows and not (gradients and GRADIENT_LOG10 in kinds):
        return torch.empty(0), []
    samples = _on(device, [h.sample for h in rows])
    if gradients and GRADIENT_LOG10 in kinds:
        # Zeros become -inf and, like NaN/Inf, stay out of the histogram.
        logs = torch.cat(_on(device, [h.sample for h in gradients])).float().abs_().log10_()
        samples += list(logs.split([h.sample.numel() for h in gradients]))
        rows += [h._replace(kind=GRADIENT_LOG10, lo=None, hi=None) for h in gradients]
    keys: dict[tuple[str, str], int] = {}
    index = [keys.setdefault((h.kind, h.name), len(keys)) for h in rows]
    lows, highs = _on(device, [h.lo for h in rows]), _on(device, [h.hi for h in rows])
    binned = stats.histograms(samples, lows, highs, index, cache)
    weights = [h.weight for h in rows]
    if any(w is not None for w in weights):  # probes' rows: scale their counts here
        one = binned.new_ones(())
        scale = torch.stack(_on(device, [one if w is None else w for w in weights])).to(binned.dtype)
        binned[:, stats.HIST_WIDTH - stats.BINS :] *= scale[:, None]
    return binned.reshape(-1), [HistMeta(h.kind, h.name, h.numel, h.sample.numel()) for h in rows]


T = TypeVar("T", Tensor, Optional[Tensor])
Item = TypeVar("Item")


def _on(device: torch.device, tensors: list[T]) -> list[T]:
    """Results of a model spread over several devices, moved to one (a no-op on one device)."""
    return [t if t is None or t.device == device else t.to(device, non_blocking=True) for t in tensors]


def _gradient(grad: Tensor | None) -> tuple[Tensor, Tensor] | None:
    """A parameter's gradient as dense tensors for its norm and its histogram: this rank's shard
    of an FSDP2 gradient, the summed values of a sparse one (``stats.sparse_values``); ``None``
    if it is not logged."""
    if grad is not None and grad.layout == torch.sparse_coo and grad.dtype in stats.FLOAT_DTYPES:
        return stats.sparse_values(grad)
    if not stats.loggable(grad):
        return None
    local = local_shard(grad)  # type: ignore[arg-type]  # loggable: a tensor
    return local, local


def _loggable_leaves(tree: object) -> list[Tensor]:
    """The tensors of a (nested) input or output that statistics are taken of."""
    if isinstance(tree, Tensor):
        leaves = [tree]
    elif _flat_inputs(tree):  # the usual forward pre-hook input, without pytree's walk
        leaves = list(tree[0])  # type: ignore[index]  # (_flat_inputs: a pair holding a tuple)
    else:
        leaves = tree_flatten(tree)[0]
    return [t for t in leaves if stats.loggable(t)]


def _flat_inputs(tree: object) -> bool:
    """Whether ``tree`` is a pre-hook's ``(args, kwargs)`` with no keyword arguments and only
    tensors among the arguments."""
    return (
        type(tree) is tuple
        and len(tree) == 2
        and type(tree[0]) is tuple
        and not tree[1]
        and all(isinstance(a, Tensor) for a in tree[0])
    )


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


def _on_probe(collector: weakref.ref[Collector], name: str, summed: Tensor) -> None:
    alive = collector()
    if alive is not None:
        alive.on_probe(name, summed)


class _GradientHook:
    """Tensor hook on a module output: records the gradient, never changes it."""

    __slots__ = ("calls", "collector", "name")

    def __init__(self, collector: Collector, name: str) -> None:
        self.collector, self.name, self.calls = collector, name, 0

    def __call__(self, grad: Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.collector.repeated_backward(self.name)
        self.collector.on_output_grad(self.name, grad)
