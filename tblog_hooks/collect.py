"""What the hooks record during one logged step, kept on the device until the step ends.

The hooks (see ``hooks.py``) call into a :class:`Collector`. It never reads a tensor value
on the host; :meth:`Collector.finish` packs everything recorded into one float64 tensor
plus a :class:`Layout` that says what each number is.
"""

from __future__ import annotations

import contextlib
import math
import threading
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from . import pictures, stats
from .distributed import is_sharded, local_shard
from .passes import PassFilter
from .tags import tag

ACTIVATION, GRADIENT, PARAM, PARAM_GRAD = "activation", "gradient", "param", "param_grad"
INPUT, GRADIENT_LOG10, FEATURE_MAP = "input", "gradient_log10", "feature_map"


@dataclass
class Layout:
    """Host-side description of a packed step: which module/parameter each number belongs to."""

    activations: list[tuple[str, int, int]] = field(default_factory=list)  # name, numel, channels
    gradients: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    hists: list[tuple[str, str]] = field(default_factory=list)  # kind, name
    hist_weights: list[float] = field(default_factory=list)  # elements each sampled element stands for
    inputs: list[tuple[str, int, int]] = field(default_factory=list)  # as activations, for inputs=True
    extras: list[tuple[str, tuple[int, ...]]] = field(default_factory=list)  # tag, shape

    def sizes(self) -> list[int]:
        """Lengths of the packed groups before the histogram rows, in packing order (see
        :meth:`Collector.finish`); the first four hold one record per call."""
        acts, grads, inputs = len(self.activations), len(self.gradients), len(self.inputs)
        extras = sum(math.prod(shape) for _, shape in self.extras)
        return [acts * 4, acts * 3, grads, grads, len(self.params), inputs * 4, inputs * 3, extras]


@dataclass
class Options:
    activations: bool = True
    gradients: bool = True
    parameters: bool = True
    histograms: bool = True
    eval_passes: bool = False
    inputs: bool = False
    feature_maps: frozenset[str] = frozenset()


class Collector:
    """Per-step buffer of device results, fed by the hooks; holds no module or model."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.active = False
        self.passes = PassFilter(eval_passes=options.eval_passes)
        self.disabled: set[str] = set()
        # Hooks can run on several threads at once (backward on one thread per device,
        # nn.DataParallel replicas): rows and their layout entries are appended together.
        self._lock = threading.Lock()
        self._act_floats: list[Tensor] = []
        self._act_counts: list[Tensor] = []
        self._grad_norms: list[Tensor] = []
        self._grad_nonfinite: list[Tensor] = []
        self._samples: list[tuple[tuple[str, str], Tensor, float]] = []
        self._param_norms: dict[str, Tensor] = {}
        self._param_samples: dict[str, list[tuple[tuple[str, str], Tensor, float]]] = {}
        self._tensor_handles: list[RemovableHandle] = []
        self._input_floats: list[Tensor] = []
        self._input_counts: list[Tensor] = []
        self._extras: dict[str, Tensor] = {}  # tag -> device tensor, packed after the groups
        self._before_update: tuple[list[tuple[str, Tensor]], Sequence[Tensor], list[Tensor]] | None = None
        # The latest activation recorded: (weakref to it, its version, its NaN/Inf count).
        self._last_output: tuple[weakref.ref[Tensor], int, Tensor] | None = None
        self.forward_order: list[str] = []  # watched modules in the order their forward hooks first fired
        self._fired: set[str] = set()
        self.layout = Layout()

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
            if name in self.options.feature_maps:
                self._add_feature_map(name, tensors)
            if self.options.activations and counted.activations:
                for t in tensors:
                    counts = self._add_row(self._act_floats, self._act_counts, self.layout.activations, name, t)
                    self._add_sample(ACTIVATION, name, t)
                    if not torch.compiler.is_compiling():  # (a weakref would break the graph)
                        # Read by the next module's pre-hook if its input is this very tensor.
                        self._last_output = (weakref.ref(t), t._version, counts[stats.NONFINITE])
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
            for t in _loggable_leaves(inputs):
                if self.options.inputs:
                    self._add_row(self._input_floats, self._input_counts, self.layout.inputs, name, t)
                else:
                    self._add_extra(tag(INPUT, "nonfinite", name), self._nonfinite_input(t))
        except Exception as error:
            self.fail(name, error)

    def on_output_grad(self, name: str, grad: Tensor) -> None:
        if name in self.disabled:
            return
        try:
            if not stats.loggable(grad):
                return
            norm, nonfinite = stats.gradient_row(grad)
            with self._exclusive():
                self._grad_norms.append(norm)
                self._grad_nonfinite.append(nonfinite)
                self.layout.gradients.append(name)
            if self.options.histograms:
                key, s, weight = _sampled(GRADIENT, name, grad)
                self._samples.append((key, s, weight))
                # Zeros become -inf and, like NaN/Inf, stay out of the histogram.
                self._samples.append(((GRADIENT_LOG10, name), s.abs().log10_(), weight))
        except Exception as error:
            self.fail(name, error)

    def on_params(self, named: list[tuple[str, Tensor]], scale: Tensor | None = None) -> None:
        """Record gradient norms (and histograms) of parameters whose ``.grad`` is final; divided
        on the device by ``scale``, the loss scale still in ``.grad`` (see ``amp.grad_scale``)."""
        try:
            named = [(key, p) for key, p in named if key not in self.disabled and stats.loggable(p.grad)]
            if not named:
                return
            grads = [local_shard(p.grad) for _, p in named if p.grad is not None]
            norms = torch._foreach_norm(grads)
            for (key, p), grad, norm in zip(named, grads, norms):
                divisor = None if scale is None else scale.to(norm.device).reshape(())
                self._param_norms[key] = norm if divisor is None else norm / divisor
                if self.options.histograms:
                    sample = _sampled(PARAM_GRAD, key, grad)
                    if divisor is not None:
                        sample[1].div_(divisor)
                    self._param_samples[key] = [sample, _sampled(PARAM, key, local_shard(p))]
        except Exception as error:
            self.fail(named[0][0] if len(named) == 1 else "parameters", error)
            self.disabled.update(key for key, _ in named)

    def before_update(self, named: list[tuple[str, Tensor]]) -> None:
        """Optimizer step pre-hook: copy the weights (logged steps only) to measure the update.
        FSDP2-sharded weights are left out: a shard's ratio is not the parameter's."""
        named = [(key, p) for key, p in named if not is_sharded(p)]
        if not named:
            return
        try:
            weights = [p.detach() for _, p in named]
            self._before_update = (named, torch._foreach_norm(weights), [w.clone() for w in weights])
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
            torch._foreach_sub_(before, [p.detach() for _, p in named])
            for (key, _), delta, norm in zip(named, torch._foreach_norm(before), norms):
                self._extras[tag(PARAM, "update_ratio", key)] = delta / norm
        except Exception as error:
            self.fail("update_ratio", error)

    # -- bookkeeping -----------------------------------------------------------------------
    def _add_row(
        self, floats: list[Tensor], counts: list[Tensor], entries: list[tuple[str, int, int]], name: str, t: Tensor
    ) -> Tensor:
        """Statistics of an output or input, appended with its layout entry; returns the counts."""
        row, row_counts = stats.activation_row(t)
        entry = (name, t.numel(), stats.channels(t))  # before appending: rows and layout stay aligned
        with self._exclusive():
            floats.append(row)
            counts.append(row_counts)
            entries.append(entry)
        return row_counts

    def _nonfinite_input(self, t: Tensor) -> Tensor:
        """NaN/Inf count of an input; reused when the input is the unchanged output of the
        watched module that ran just before (conv -> bn in a ResNet), saving a pass over it."""
        last = self._last_output
        if last is not None and last[0]() is t and t._version == last[1]:
            return last[2]
        return stats.nonfinite(t.detach())

    def _exclusive(self) -> contextlib.AbstractContextManager[object]:
        # A lock cannot be traced by torch.compile (and a compiled forward runs on one thread).
        return contextlib.nullcontext() if torch.compiler.is_compiling() else self._lock

    def _watch_gradient(self, name: str, t: Tensor) -> None:
        # Inside torch.compile a hook that writes to the collector breaks the graph at every
        # module (dynamo cannot trace the mutation, and a disabled hook is a break too), so
        # compiled forwards record activations and leave output gradients out.
        if not torch.compiler.is_compiling():
            self._tensor_handles.append(t.register_hook(_GradientHook(self, name)))

    def _add_extra(self, key: str, value: Tensor) -> None:
        """A device value packed as is; values of a tag recorded more than once add up."""
        with self._exclusive():
            previous = self._extras.get(key)
            self._extras[key] = value if previous is None else previous + value

    def _add_feature_map(self, name: str, tensors: list[Tensor]) -> None:
        """Channels of the first sample of the first 3-D-or-more output, first call only."""
        key = tag(FEATURE_MAP, name)
        maps = [t for t in tensors if t.dim() >= 3]
        if maps and key not in self._extras:
            self._extras[key] = pictures.feature_grid(maps[0].detach()[0])

    def _add_sample(self, kind: str, name: str, t: Tensor) -> None:
        if self.options.histograms:
            self._samples.append(_sampled(kind, name, t))

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

    def _take_diagnostics(self, layout: Layout) -> list[list[Tensor]]:
        """This step's input rows and extras as packing groups (after the core ones); resets them."""
        groups, extras = [self._input_floats, self._input_counts], self._extras
        self._input_floats, self._input_counts, self._extras, self._before_update = [], [], {}, None
        layout.extras = [(key, tuple(value.shape)) for key, value in extras.items()]
        if extras:
            values = _gather(list(extras.values()), next(iter(extras.values())).device)
            groups.append([torch.cat([v.reshape(-1).to(torch.float64) for v in values])])
        return groups

    def finish(self) -> tuple[Tensor, Layout] | None:
        """Pack everything recorded this step into one float64 tensor; reset the buffer.

        Order: activation float rows, activation count rows, gradient norms, gradient
        non-finite counts, parameter-gradient norms, input float rows, input count rows,
        extras (flattened), histogram rows (see ``Layout``)."""
        self.remove_tensor_hooks()
        self._last_output = None
        layout, self.layout = self.layout, Layout()
        groups = [self._act_floats, self._act_counts, self._grad_norms, self._grad_nonfinite]
        self._act_floats, self._act_counts, self._grad_norms, self._grad_nonfinite = [], [], [], []
        samples = self._samples + [s for pair in self._param_samples.values() for s in pair]
        self._samples, self._param_samples = [], {}
        norms, self._param_norms = self._param_norms, {}
        layout.params = list(norms)
        groups.append(list(norms.values()))
        groups += self._take_diagnostics(layout)
        firsts = [g[0] for g in groups if g] + [s for _, s, _ in samples[:1]]
        if not firsts:
            return None
        device = firsts[0].device
        parts = [torch.stack(_gather(g, device)).to(torch.float64).reshape(-1) for g in groups if g]
        if samples:
            merged = _merge_samples(samples)
            layout.hists = list(merged)
            layout.hist_weights = [w for _, w in merged.values()]
            parts.append(stats.histograms(_gather([s for s, _ in merged.values()], device)).reshape(-1))
        return torch.cat(parts), layout


def _loggable_leaves(tree: object) -> list[Tensor]:
    """The tensors of a (nested) input or output that statistics are taken of."""
    leaves = [tree] if isinstance(tree, Tensor) else tree_flatten(tree)[0]
    return [t for t in leaves if stats.loggable(t)]


def _sampled(kind: str, name: str, t: Tensor) -> tuple[tuple[str, str], Tensor, float]:
    """A histogram sample of ``t`` and how many elements each sampled element stands for."""
    s = stats.sample(t)
    return (kind, name), s, t.numel() / s.numel()


def _merge_samples(
    samples: list[tuple[tuple[str, str], Tensor, float]],
) -> dict[tuple[str, str], tuple[Tensor, float]]:
    """One sample per tag: calls of the same module in one step are pooled (re-sampled
    to the cap if needed), each element then standing for ``total elements / length``."""
    grouped: dict[tuple[str, str], list[tuple[Tensor, float]]] = {}
    for key, s, weight in samples:
        grouped.setdefault(key, []).append((s, weight))
    merged = {}
    for key, parts in grouped.items():
        if len(parts) == 1:
            merged[key] = parts[0]
            continue
        represented = sum(s.numel() * w for s, w in parts)
        pooled = stats.sample(torch.cat([s for s, _ in parts]))
        merged[key] = (pooled, represented / pooled.numel())
    return merged


def _gather(tensors: list[Tensor], device: torch.device) -> list[Tensor]:
    """Move results of a model spread over several devices to one (a no-op on one device)."""
    if all(t.device == device for t in tensors):
        return tensors
    return [t.to(device, non_blocking=True) for t in tensors]


class _GradientHook:
    """Tensor hook on a module output: records the gradient, never changes it."""

    __slots__ = ("collector", "name")

    def __init__(self, collector: Collector, name: str) -> None:
        self.collector, self.name = collector, name

    def __call__(self, grad: Tensor) -> None:
        self.collector.on_output_grad(self.name, grad)
