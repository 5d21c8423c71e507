"""Gradients w.r.t. module outputs under ``torch.compile``, recorded without a graph break.

A tensor hook that writes into the collector cannot be traced (dynamo would break the graph
at every module). Instead, on logged steps, the forward hook passes each output through
:class:`_Tap`: its forward returns a copy (a view would make a later in-place op such as
``ReLU(inplace=True)`` fail, as it does with full backward hooks); its backward passes the
gradient on unchanged and returns, as the gradient of the module's *probe* (a leaf tensor the
logger owns), a :func:`summary` of that gradient. Autograd delivers it to the probe outside the
compiled graph, like any leaf's gradient, and a post-accumulate-grad hook hands it to the
collector: the graph itself has no side effect for dynamo to trace.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..kernels import Kernels
from ..kernels.outputs import copied_sample
from ..stats.kinds import Kind
from ..stats.sampling import traced_sample
from .watched import Handles

#: Positions in a summary: the gradients summed into it (more than one when the module ran
#: twice in one forward: autograd adds up the probe's gradients within a backward), elements; then
#: the fields of the logger's output-gradient kind in the form that adds up (``Pool.summed``; its
#: element count among them where its measures need it, ``kinds.ELEMENTS``), the min and max, and
#: the histogram sample, padded with NaN (:func:`summary`).
S_CALLS, S_NUMEL, S_FIELDS = range(3)


def _fields(kind: Kind) -> int:
    """How many elements ``kind``'s (the output gradient's) device values hold in all (``Field.size``)."""
    return sum(f.size * len(f.names) for f in kind.fields)


def head(kind: Kind) -> int:
    """Where a summary's histogram sample starts."""
    return S_FIELDS + _fields(kind) + 2


class _Tap(torch.autograd.Function):
    """Identity on the output; its backward sends the gradient's summary to the probe."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, probe: Tensor, width: int, kind: Kind, kernels: Kernels) -> Tensor:
        ctx.width, ctx.kind, ctx.kernels = width, kind, kernels
        return x.clone()  # not x itself: that would be a view, and in-place ops on views of this fail

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None, None]:
        return grad, summary(grad, ctx.width, ctx.kind, ctx.kernels), None, None, None


def summary(grad: Tensor, width: int, kind: Kind, kernels: Kernels) -> Tensor:
    """``[1, elements, kind's fields..., min, max]`` of ``grad`` in float64, then its histogram
    sample (the kernels' copy, else ``sampling.traced_sample``: it runs in the compiled backward)
    padded with NaN to ``width`` (0: no histogram)."""
    named = kernels.compute((kind,), grad, -1, sample=bool(width))
    wide = torch.float64
    values = torch.cat([named[n].to(wide).reshape(f.size) for f in kind.fields for n in f.names])
    lo, hi = (named["min"], named["max"]) if "min" in named else torch.aminmax(grad)  # (the kernels give them)
    measured = torch.cat([*_each_field(kind, values, forward=True), torch.stack([lo.to(wide), hi.to(wide)])])
    parts = [torch.tensor([1.0, grad.numel()], dtype=wide, device=grad.device), measured]
    if width:
        copied = copied_sample(named)
        sample = (traced_sample(grad) if copied is None else copied).to(wide)
        parts += [sample, sample.new_full((width - sample.numel(),), math.nan)]
    return torch.cat(parts)


def _each_field(kind: Kind, values: Tensor, *, forward: bool, calls: Tensor | None = None) -> list[Tensor]:
    """``values`` (``kind``'s, in field order) field by field, each into the form that adds up
    (``forward``) or back; a field that does not add up stays, or back is NaN where ``calls``
    (summaries added up) is not 1."""
    out, at = [], 0
    for f in kind.fields:
        v, at = values[at : at + f.size * len(f.names)], at + f.size * len(f.names)
        if f.pool.summed is not None:
            out.append(f.pool.summed[0 if forward else 1](v))
        else:
            out.append(v if calls is None else torch.where(calls == 1, v, math.nan))
    return out


def gradient(summed: Tensor, kind: Kind) -> tuple[Tensor, ...]:
    """``kind``'s values from a summary, or several added up: the summable fields stay right,
    the others are NaN (their sums mean nothing). A value of :attr:`~tblog_hooks.stats.kinds.Field.size`
    1 is 0-d, a longer one a slice (one op for all the 0-d ones)."""
    values = summed[S_FIELDS : S_FIELDS + _fields(kind)]
    values = torch.cat(_each_field(kind, values, forward=False, calls=summed[S_CALLS]))
    each, out, at = values.unbind(), [], 0
    for size in (f.size for f in kind.fields for _ in f.names):
        out.append(each[at] if size == 1 else values[at : at + size])
        at += size
    return tuple(out)


def histogram(summed: Tensor, kind: Kind) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The sample, exact min and max, and the elements each sampled one stands for, from a
    summary of ``kind``'s; all NaN where several summaries were added up (their sums mean nothing)."""
    kept = torch.where(summed[S_CALLS] == 1, summed, math.nan)
    low = S_FIELDS + _fields(kind)
    sample, numel = kept[low + 2 :], summed[S_NUMEL]
    return sample, kept[low], kept[low + 1], numel / numel.clamp(max=sample.numel())


class Probe:
    """One watched module's leaf tensor; ``deliver`` receives each summary that reaches it (one
    per backward through the module's tapped outputs), of ``kind``'s fields (its layout is fixed
    with the logger's recipe)."""

    def __init__(
        self,
        device: torch.device,
        width: int,
        kind: Kind,
        kernels: Kernels,
        deliver: Callable[[Tensor], None],
        handles: Handles,
    ) -> None:
        self.width, self.kind, self.kernels = width, kind, kernels
        # Stride 0: one element of storage whatever the summary's length.
        self.tensor = torch.empty_strided((head(kind) + width,), (0,), dtype=torch.float64, device=device)
        self.tensor.requires_grad_()
        # The hook holds neither the probe nor its tensor: no reference cycle through a tensor hook.
        handles.add(self.tensor.register_post_accumulate_grad_hook(functools.partial(_take, deliver)))

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def tap(self, x: Tensor) -> Tensor:
        """``x`` (a copy) whose gradient will be summarised into the probe."""
        return _Tap.apply(x, self.tensor, self.width, self.kind, self.kernels)  # type: ignore[no-any-return]


def _take(deliver: Callable[[Tensor], None], tensor: Tensor) -> None:
    grad, tensor.grad = tensor.grad, None  # one summary at a time: nothing accumulates
    if grad is not None:
        deliver(grad)


def home_device(module: nn.Module, model: nn.Module) -> torch.device:
    """Where a module's outputs will be: its first parameter's or buffer's device, else the
    model's, else the CPU."""
    for holder in (module, model):
        for t in itertools.chain(holder.parameters(), holder.buffers()):
            return t.device
    return torch.device("cpu")
