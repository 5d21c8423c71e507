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
    histograms: bool = True
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
        self._indices = stats.IndexCache()  # sample and histogram-row indices, made once per size
        self.forward_order: list[str] = []  # watched modules in the order their forward hooks first fired
        self._fired: set[str] = set()

    @property
    def empty(self) -> bool:
        """Whether nothing was recorded since the last :meth:`finish`."""
        return not (self._records or self._hists or self._graded)

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
                            self._last_output = (weakref.ref(t), t._version, ACTIVATION.value(values, "nonfinite"))
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
                self._record(GRADIENT, name, grad)
        except Exception as error:
            self.fail(name, error)

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
                samples = self._samples(PARAM_GRAD.name, keys, shown) if self.options.histograms else {}
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

    def on_weights(self, named: list[tuple[str, Tensor]]) -> None:
        """Histograms of the weights whose gradients this step recorded, as they are at the end
        of the step (after the update)."""
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
    def _record(self, kind: Kind, name: str, t: Tensor) -> tuple[Tensor, ...]:
        """Statistics (and a histogram sample over their exact range) of an output, input or
        output gradient; returns the values."""
        values = kind.compute(t)  # type: ignore[misc]  # kinds recorded from tensors have one
        self._records.append(Record(kind, name, t.numel(), values))
        if self.options.histograms:
            lo, hi = kind.value(values, "min"), kind.value(values, "max")
            self._hists.append(HistRow(kind.name, name, stats.sample(t, self._indices), t.numel(), lo, hi))
        return values

    def _samples(self, kind: str, keys: list[str], tensors: list[Tensor]) -> dict[str, HistRow]:
        """Histogram samples of parameters or their gradients, over the sample's own range (no
        pass over the whole tensor); empty FSDP2 shards have none."""
        return {
            key: HistRow(kind, key, stats.sample(t, self._indices), t.numel(), None, None)
            for key, t in zip(keys, tensors)
            if t.numel()
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

    def release(self) -> None:
        """The logger is done: stop recording, remove tensor hooks, drop cached tensors."""
        self.active = False
        self.remove_tensor_hooks()
        self._indices.clear()

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
            binned, rows = _histograms(hists, device, self._indices)
            records.append(Record(HISTOGRAM, "", binned.numel(), (binned,), (len(rows), stats.HIST_WIDTH)))
        packed, layout = pack(records, device)
        layout.hists = rows
        return packed, layout


def _histograms(hists: list[HistRow], device: torch.device, cache: stats.IndexCache) -> tuple[Tensor, list[HistMeta]]:
    """Every histogram of the step binned at once (``stats.histograms`` rows, flattened), and
    what each row is; the log10 histograms of the output gradients are derived here."""
    gradients = [h for h in hists if h.kind == GRADIENT.name]
    rows = list(hists)
    samples = _on(device, [h.sample for h in hists])
    if gradients:
        # Zeros become -inf and, like NaN/Inf, stay out of the histogram.
        logs = torch.cat(_on(device, [h.sample for h in gradients])).float().abs_().log10_()
        samples += list(logs.split([h.sample.numel() for h in gradients]))
        rows += [HistRow(GRADIENT_LOG10, h.name, h.sample, h.numel, None, None) for h in gradients]
    keys: dict[tuple[str, str], int] = {}
    index = [keys.setdefault((h.kind, h.name), len(keys)) for h in rows]
    lows, highs = _on(device, [h.lo for h in rows]), _on(device, [h.hi for h in rows])
    binned = stats.histograms(samples, lows, highs, index, cache)
    return binned.reshape(-1), [HistMeta(h.kind, h.name, h.numel, h.sample.numel()) for h in rows]


T = TypeVar("T", Tensor, Optional[Tensor])


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
    leaves = [tree] if isinstance(tree, Tensor) else tree_flatten(tree)[0]
    return [t for t in leaves if stats.loggable(t)]


class _GradientHook:
    """Tensor hook on a module output: records the gradient, never changes it."""

    __slots__ = ("collector", "name")

    def __init__(self, collector: Collector, name: str) -> None:
        self.collector, self.name = collector, name

    def __call__(self, grad: Tensor) -> None:
        self.collector.on_output_grad(self.name, grad)
