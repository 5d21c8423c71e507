"""Attention statistics of every ``scaled_dot_product_attention`` call a logged forward pass makes,
seen without patching the function or the model.

A forward pre-hook on the model, and on each of its children (a training step may call them
without the model's own forward: Lightning's ``training_step``, ``checkpoint_sequential``),
enters a ``TorchFunctionMode`` when a counted forward pass of a logged step begins (the first of
them: calls nested in it only count), and its forward hook (``always_call``: also when the forward
raises) leaves it; on other steps they return at once and no mode is active. Which passes count is
decided as for the activations (``passes.py``): a reentrant checkpoint's first pass runs under
``no_grad``, so its recompute inside backward is the pass recorded. While it is active, the
mode passes every torch function through unchanged and, after each
``F.scaled_dot_product_attention`` or ``F.multi_head_attention_forward`` call (whose own SDPA
call a mode cannot see), recomputes the logits from the call's detached query and key
(``stats/attention.py``) into the step buffer. The call is named after the innermost module of
the model whose code is running, found on the Python call stack, so no per-module hook is needed.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._compat import function_mode_on_top
from ..stats.attention import attention_statistics, mha_arguments, sdpa_arguments
from ..stats.packing import Record
from ..stats.recipe import Source
from ..topology.parallel import TensorParallel
from .passes import PassFilter
from .selection import ROOT_NAME, Selector, named_modules, select_modules
from .step import Part, StepBuffer
from .watched import _Hook

_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward


class AttentionRecorder:
    """Records ``attention/*`` of the calls made inside the covered modules (all, with ``True``)."""

    def __init__(
        self,
        buffer: StepBuffer,
        model: nn.Module,
        selectors: bool | Selector | Sequence[Selector],
        *,
        eval_passes: bool,
        parallel: TensorParallel,
    ) -> None:
        self.buffer, self.eval_passes, self.parallel = buffer, eval_passes, parallel
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        for name, _, module in named_modules(model):
            self._names.setdefault(module, name or ROOT_NAME)
        self._covered: frozenset[str] | None = None  # None: every module
        if selectors is not True:
            self._covered = frozenset(select_modules(model, selectors, "attention"))  # type: ignore[arg-type]
        self._mode = _Capture(self)
        self._passes = PassFilter(eval_passes=eval_passes)
        self._depth = 0  # nested calls of the model inside the forward pass that entered the mode
        self._compiled = self._compile_warned = False

    def hooks(self) -> tuple[Callable[..., None], Callable[..., None]]:
        """The forward pre-hook and forward hook of the :meth:`entries` (register the latter with
        ``always_call=True``)."""
        return _Enter(self), _Leave(self)

    @staticmethod
    def entries(model: nn.Module) -> list[nn.Module]:
        """The modules whose forward starts a capture: the model and its children."""
        return [model, *model.children()]

    def enter(self, module: nn.Module) -> None:
        """An entry's forward begins: capture its attention calls if it is a counted pass of a
        logged step (training, or any with ``eval_passes``; a checkpoint's recompute only where
        its first pass ran without gradients)."""
        if self._depth:
            self._depth += 1
            return
        if not self.buffer.active or Part.ATTENTION in self.buffer.disabled:
            return
        mode = self.buffer.now()
        if mode is not None and mode.compiled:
            self._compiled = True
            return
        name = self._names.get(module, ROOT_NAME)
        if mode is None or not self._passes.classify(name, module.training, mode.in_backward()).activations:
            return
        self._mode.__enter__()
        self._depth = 1

    def leave(self) -> None:
        """The model's forward returned or raised: leave the mode once the outermost call ends."""
        if self._depth:
            self._depth -= 1
            if not self._depth:
                self._pop()

    def end_step(self) -> None:
        """The logged step ended: leave the mode if a forward never returned; warn once if the
        model ran compiled (its attention calls are not seen)."""
        if self._depth:
            self._depth = 0
            self._pop()
        self._passes.reset()
        if self._compiled and not self._compile_warned:
            self._compile_warned = True
            warnings.warn(
                "tblog_hooks: attention= records nothing inside torch.compile'd code, so attention/* is not logged "
                "for the compiled model; run the logged steps' forward eagerly to get it, e.g. under "
                "torch.compiler.set_stance('force_eager') (docs: attention.md#torchcompile)",
                RuntimeWarning,
                stacklevel=4,
            )

    def _pop(self) -> None:
        if function_mode_on_top(self._mode):
            self._mode.__exit__(None, None, None)
        else:  # a mode entered inside the forward and never left sits above ours
            self.buffer.fail(
                Part.ATTENTION, RuntimeError("another TorchFunctionMode was left active by the forward pass")
            )

    def on_call(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """After an attention call: record its statistics under its innermost module's name."""
        mode = self.buffer.now()
        if mode is not None and mode.compiled:
            self._compiled = True
            return
        if mode is None or Part.ATTENTION in self.buffer.disabled:
            return
        try:
            running = self._running()
            if running is None:
                return
            name, module = running
            with torch.no_grad():
                found = sdpa_arguments(args, kwargs) if func is _SDPA else mha_arguments(func, args, kwargs)
                found["query"], found["key"] = found["query"].detach(), found["key"].detach()
                values = attention_statistics(**found)
            split = self.parallel.heads(module)
            kind = self.buffer.recipe[Source.ATTENTION]
            mode.add(Record(kind, name, found["query"].shape[:-1].numel(), values, split=split))
        except Exception as error:  # the logger must never stop training
            self.buffer.fail(Part.ATTENTION, error)

    def _running(self) -> tuple[str, nn.Module] | None:
        """The innermost module of the model whose code is on the call stack (its name and
        itself), if it or a module around it is covered."""
        innermost: tuple[str, nn.Module] | None = None
        frame = inspect.currentframe()
        while frame is not None:
            owner = frame.f_locals.get("self")
            name = self._names.get(owner) if isinstance(owner, nn.Module) else None
            if name is not None:
                innermost = innermost or (name, owner)  # type: ignore[assignment]  # (owner: a module)
                if self._covered is None or name in self._covered:
                    return innermost
            frame = frame.f_back
        return None


class _Capture(TorchFunctionMode):
    """Passes every torch function through; reports the attention calls after they ran."""

    def __init__(self, recorder: AttentionRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is _SDPA or func is _MHA:
            self.recorder.on_call(func, args, kwargs)
        return out


class _Enter(_Hook):
    """The model's forward pre-hook."""

    __slots__ = ("recorder",)

    def __init__(self, recorder: AttentionRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.recorder.enter(module)


class _Leave(_Enter):
    """The model's forward hook (``always_call=True``)."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any = None) -> None:
        self.recorder.leave()
