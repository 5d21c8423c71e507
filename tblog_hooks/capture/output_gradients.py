"""Gradients w.r.t. the watched modules' outputs: a tensor hook on each output of a training pass
(eagerly), or the module's probe (under ``torch.compile``, see ``probes.py``)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from .._compat import tree_flatten, tree_unflatten
from ..stats import sampling
from ..stats.binning import Sample
from ..stats.packing import Record
from ..stats.recipe import Source
from ..stats.reductions import loggable
from ..stats.tags import Root
from ..topology.sharding import Pending, Split, TermsOf, is_dtensor, local, pending, terms
from . import probes
from .step import Mode, StepBuffer
from .watched import Handles

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


class OutputGradientRecorder:
    """Records ``gradient/*`` of the watched modules' outputs during a logged step's backward."""

    def __init__(self, buffer: StepBuffer, *, histograms: bool) -> None:
        self.buffer = buffer
        recipe = buffer.recipe
        self._output, self._kind = recipe[Source.OUTPUT], recipe[Source.OUTPUT_GRADIENT]
        # With fp8_scaling="rowwise": the watched Linears' gradients as that recipe casts them.
        self._casts = recipe.numerics.get(Source.FP8_GRADIENT)
        self._linears: frozenset[str] = frozenset()
        self._width = sampling.SAMPLE_CAP if histograms else 0  # of a probe's histogram sample
        self._handles = Handles()  # this step's tensor hooks
        self._probe_handles = Handles()  # the probes' own hooks, live until release()
        self._probes: dict[str, probes.Probe] = {}
        self._warned_repeated = False
        self._pending: list[Pending] = []  # this step's gradients placed Partial, one per call

    def place_probes(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        """A probe per watched module, on the device its outputs will be on: made now, before
        ``torch.compile`` traces the hooks (one made later would be one more graph); and which of
        them are Linears, whose gradients fp8 training casts."""
        for name, module in modules.items():
            self._place_probe(name, probes.home_device(module, model))
        self._linears = frozenset(name for name, module in modules.items() if isinstance(module, nn.Linear))

    def watch(
        self,
        mode: Mode,
        name: str,
        output: object,
        tensors: list[Tensor],
        splits: list[Split | None],
        summed_over: DeviceMesh | None = None,
    ) -> object | None:
        """Watch the gradients of a training pass's outputs (``tensors``, the loggable leaves of
        ``output``, each split over ranks as ``splits`` says; ``summed_over``: the mesh over which
        plain gradients are terms of a sum, ``TensorParallel.gradient_terms``); returns the output
        to use instead, if any."""
        if mode.compiled:
            return self._tap(name, output)
        for t, split in zip(tensors, splits):
            if t.requires_grad:
                self._handles.add(t.register_hook(_GradientHook(self, name, split, summed_over)))
        return None

    def on_grad(self, name: str, grad: Tensor, split: Split | None, summed_over: DeviceMesh | None = None) -> None:
        """A tensor hook's gradient (of an output split as ``split``; a ``DTensor``'s says itself).
        One placed ``Partial`` (a ``Replicate`` output's, whose consumers each hold a term of it),
        or a plain term of a sum over ``summed_over``, is copied and recorded once reduced over
        the ranks at the end of the step (:meth:`resolve`)."""
        self.buffer.trained = True
        if name in self.buffer.disabled_names:
            return
        try:
            if not loggable(grad):
                return
            with torch.no_grad():
                of = TermsOf.OUTPUT_GRADIENT
                waiting = terms(name, grad, summed_over, of) if summed_over is not None else pending(name, grad, of)
                if waiting is not None:
                    self._pending.append(waiting)
                    return
                if is_dtensor(grad):  # (its units are where its output's were)
                    grad, placed = local(grad)
                    split = placed and dataclasses.replace(placed, axis=split.axis if split else placed.axis)
                self.buffer.eager.record(self._kind, name, grad, split=split)
                self._fp8_casts(name, grad, split)
        except Exception as error:
            self.buffer.fail(name, error)

    def on_probe(self, name: str, summed: Tensor) -> None:
        """A probe's gradient: the summary of one backward through the module (``probes.py``).
        Under CUDA graphs the summary is the backward graph's output, and this backward's
        forward records are the forward graph's, which the next micro-batch overwrites: both
        are copied out here (``StepBuffer.keep_traced``)."""
        buffer = self.buffer
        if not buffer.active:  # a backward after its logged step ended
            return
        buffer.trained = True
        if name in buffer.disabled_names:
            return
        try:
            with torch.no_grad():
                buffer.keep_traced()
                summed = summed.clone()
                # Elements are on the device only: the kind's records carry them where needed.
                buffer.eager.add(Record(self._kind, name, 0, probes.gradient(summed, self._kind)))
                if buffer.eager.takes_histogram(Root.GRADIENT):
                    sample, lo, hi, weight = probes.histogram(summed, self._kind)
                    buffer.eager.add(Sample(Root.GRADIENT, name, sample, sample.numel(), lo, hi, weight))
        except Exception as error:
            buffer.fail(name, error)

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

    def resolve(self, waiting: list[Pending], reduced: list[Tensor]) -> tuple[list[Record], list[Sample]]:
        """Records and histogram samples of output gradients placed ``Partial``, from their terms
        ``reduced`` over ranks (``Ranks.finish``)."""
        with torch.no_grad():
            for p, t in zip(waiting, reduced):
                whole, split = p.whole(t)
                self.buffer.eager.record(self._kind, p.key, whole, split=split)
                self._fp8_casts(p.key, whole, split)
        return self.buffer.drain()

    def _fp8_casts(self, name: str, grad: Tensor, split: Split | None) -> None:
        """With ``fp8_scaling="rowwise"``, a Linear's output gradient as that recipe casts it (a
        whole gradient: not of a tensor-parallel piece, whose rows and columns are one rank's)."""
        if self._casts is not None and name in self._linears and split is None:
            self.buffer.eager.measure(self._casts, name, grad)

    def mark(self) -> int:
        """How many gradients placed ``Partial`` this step holds now, for :meth:`rewind`."""
        return len(self._pending)

    def rewind(self, mark: int) -> None:
        """Drop the gradients placed ``Partial`` that came after ``mark``."""
        del self._pending[mark:]

    def end_step(self, records: list[Record]) -> list[Pending]:
        """A logged step ended: remove its tensor hooks; probes of modules whose outputs turned
        out to be on another device (the model was moved after attaching) follow them, at the
        cost of one more graph. Returns the gradients still to be reduced over ranks."""
        self._handles.remove_all()
        waiting, self._pending = self._pending, []
        for record in records:
            probe = self._probes.get(record.name)
            if record.kind is self._output and probe is not None and probe.device != record.values[0].device:
                self._place_probe(record.name, record.values[0].device)
        return waiting

    def release(self) -> None:
        """The logger is done: remove every gradient hook, the probes' too."""
        self._handles.remove_all()
        self._probe_handles.remove_all()
        self._probes.clear()

    def _place_probe(self, name: str, device: torch.device) -> None:
        # A weak reference: the probe's tensor hook must not keep the recorder alive.
        deliver = functools.partial(_on_probe, weakref.ref(self), name)
        self._probes[name] = probes.Probe(
            device, self._width, self._kind, self.buffer.kernels, deliver, self._probe_handles
        )

    def _tap(self, name: str, output: object) -> object | None:
        """The output with each tensor that carries a gradient passed through the module's
        probe, or ``None`` (keep the output) if there is none: a tensor hook that writes into
        the buffer would break the compiled graph at every module."""
        probe = self._probes.get(name)
        if probe is None:
            return None
        leaves, spec = tree_flatten(output)
        tapped = [probe.tap(t) if loggable(t) and t.requires_grad and t.device == probe.device else t for t in leaves]
        if all(a is b for a, b in zip(tapped, leaves)):
            return None
        replaced: object = tree_unflatten(tapped, spec)
        return replaced


def _on_probe(recorder: weakref.ref[OutputGradientRecorder], name: str, summed: Tensor) -> None:
    alive = recorder()
    if alive is not None:
        alive.on_probe(name, summed)


class _GradientHook:
    """Tensor hook on a module output: records the gradient, never changes it."""

    __slots__ = ("calls", "name", "recorder", "split", "summed_over")

    def __init__(
        self, recorder: OutputGradientRecorder, name: str, split: Split | None, summed_over: DeviceMesh | None
    ) -> None:
        self.recorder, self.name, self.split, self.summed_over, self.calls = recorder, name, split, summed_over, 0

    def __call__(self, grad: Tensor) -> None:
        self.calls += 1
        if self.calls == 2:
            self.recorder.repeated_backward(self.name)
        self.recorder.on_grad(self.name, grad, self.split, self.summed_over)
