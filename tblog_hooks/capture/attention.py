"""Attention statistics of every ``scaled_dot_product_attention``, ``flex_attention`` and
``varlen_attn`` call a logged forward pass makes, seen without patching the functions or the model.

A forward pre-hook on the model, and on each of its children (a training step may call them
without the model's own forward: Lightning's ``training_step``, ``checkpoint_sequential``),
enters a ``TorchFunctionMode`` when a counted forward pass of a logged step begins (the first of
them: calls nested in it only count), and its forward hook (``always_call``: also when the forward
raises) leaves it; on other steps they return at once and no mode is active. Which passes count is
decided as for the activations (``passes.py``): a reentrant checkpoint's first pass runs under
``no_grad``, so its recompute inside backward is the pass recorded. While it is active, the
mode passes every torch function through unchanged and, after each call of a function in
:data:`_SEEN` (``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward``, whose own
SDPA call a mode cannot see, and the op ``varlen_attn`` calls), recomputes the logits from the
call's query and key (``stats/attention.py``) into the step buffer. ``flex_attention`` compiles
itself, so no mode sees it: a profile function set alongside the mode (:class:`_FlexCalls`) reads
the arguments of its frames. The call is named after the innermost module of
the model whose code is running, found on the Python call stack, so no per-module hook is needed.
"""

from __future__ import annotations

import inspect
import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from .._compat import context_parallel_mesh, flex_attention_file, function_mode_on_top, varlen_attention_ops
from ..stats.attention import (
    attention_statistics,
    flex_arguments,
    flex_attention_statistics,
    mha_arguments,
    sdpa_arguments,
    varlen_arguments,
    varlen_attention_statistics,
)
from ..stats.packing import Record
from ..stats.recipe import Source
from ..topology.parallel import TensorParallel
from .passes import PassFilter
from .selection import ROOT_NAME, Selector, named_modules, select_modules
from .step import Part, StepBuffer
from .watched import _Hook

Statistics = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
#: Why attention statistics are not recorded under context parallelism.
CONTEXT_PARALLEL = (
    "context parallelism is active: each rank holds a shard of the sequence's queries and keys, and its queries "
    "attend over every rank's keys inside the attention call, which no hook sees without a collective; "
    "attention/* is left out while it is (every other statistic pools the ranks' shards)"
)
#: Reads one attention call: ``(args, kwargs) -> (its query, its statistics)``, or ``None`` for a
#: call that is not recorded.
Reader = Callable[[tuple[Any, ...], dict[str, Any]], tuple[torch.Tensor, Statistics] | None]


def _sdpa(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Statistics]:
    found = sdpa_arguments(args, kwargs)
    return found["query"], attention_statistics(**found)


def _mha(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Statistics]:
    found = mha_arguments(F.multi_head_attention_forward, args, kwargs)
    return found["query"], attention_statistics(**found)


def _varlen(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Statistics] | None:
    found = varlen_arguments(args, kwargs)
    return None if found is None else (found["query"], varlen_attention_statistics(**found))


def _flex(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[torch.Tensor, Statistics]:
    found = flex_arguments(kwargs)  # (kwargs: the frame's arguments)
    return found["query"], flex_attention_statistics(**found)


#: The attention functions a ``TorchFunctionMode`` sees, each with its reader:
#: ``F.scaled_dot_product_attention``, ``F.multi_head_attention_forward`` (whose own SDPA call a
#: mode cannot see) and the op ``varlen_attn`` calls (:func:`varlen_attention_ops`, once
#: ``torch.nn.attention.varlen`` is imported); ``flex_attention``, which no mode sees, is
#: :class:`_FlexCalls`'.
_SEEN: dict[object, Reader] = {F.scaled_dot_product_attention: _sdpa, F.multi_head_attention_forward: _mha}


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
        merged: bool = False,
    ) -> None:
        """``merged``: the ranks' steps are combined (``PassFilter``)."""
        self.buffer, self.eval_passes, self.parallel = buffer, eval_passes, parallel
        self._names: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()
        for name, _, module in named_modules(model):
            self._names.setdefault(module, name or ROOT_NAME)
        self._covered: frozenset[str] | None = None  # None: every module
        if selectors is not True:
            self._covered = frozenset(select_modules(model, selectors, "attention"))  # type: ignore[arg-type]
        self._mode = _Capture(self)
        self._flex = _FlexCalls(self)
        self._passes = PassFilter(eval_passes=eval_passes, merged=merged)
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
        if not self.buffer.active or Part.ATTENTION in self.buffer.disabled_parts:
            return
        mode = self.buffer.now()
        if mode is not None and mode.compiled:
            self._compiled = True
            return
        name = self._names.get(module, ROOT_NAME)
        if mode is None or not self._passes.classify(name, module.training, mode.in_backward()).activations:
            return
        self._mode.__enter__()
        self._flex.start()
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
        self._flex.stop()
        if function_mode_on_top(self._mode):
            self._mode.__exit__(None, None, None)
        else:  # a mode entered inside the forward and never left sits above ours
            self.buffer.fail(
                Part.ATTENTION, RuntimeError("another TorchFunctionMode was left active by the forward pass")
            )

    def on_call(self, read: Reader, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """At an attention call: record its statistics, which ``read`` reads, under its innermost
        module's name."""
        mode = self.buffer.now()
        if mode is not None and mode.compiled:
            self._compiled = True
            return
        if mode is None or Part.ATTENTION in self.buffer.disabled_parts:
            return
        if context_parallel_mesh() is not None:
            self.buffer.fail(Part.ATTENTION, RuntimeError(CONTEXT_PARALLEL))
            return
        try:
            running = self._running()
            if running is None:
                return
            name, module = running
            with torch.no_grad():
                read_ = read(args, kwargs)
            if read_ is None:
                return
            query, values = read_
            split = self.parallel.heads(module)
            kind = self.buffer.recipe[Source.ATTENTION]
            mode.add(Record(kind, name, query.shape[:-1].numel(), values, split=split))
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
        self.seen = _SEEN

    def __enter__(self) -> _Capture:
        varlen = varlen_attention_ops()
        self.seen = {**_SEEN, **dict.fromkeys(varlen, _varlen)} if varlen else _SEEN
        return super().__enter__()  # type: ignore[no-any-return]

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        read = self.seen.get(func)
        if read is not None:
            self.recorder.on_call(read, args, kwargs)
        return out


class _FlexCalls:
    """Sees the ``flex_attention`` calls: a Python function that compiles itself (and that
    torchtitan compiles), so no ``TorchFunctionMode`` sees it, nor anything of it at run time.
    While the capture is active, a profile function (``sys.setprofile``) reads the arguments of
    each frame of it as the frame starts, compiled or not. Where another profile function is set
    (a profiler), it is left alone and those calls are not recorded: said once."""

    def __init__(self, recorder: AttentionRecorder) -> None:
        self.recorder = recorder
        self._file: str | None = None
        self._warned = False
        # (run eagerly: inside compiled code, as torchtitan's flex_attention is, dynamo would
        # compile the profile function's own frames too)
        self._profile = torch.compiler.disable(self._event)

    def start(self) -> None:
        self._file = flex_attention_file()  # (None before torch.nn.attention.flex_attention is imported)
        if self._file is None:
            return
        if sys.getprofile() is not None:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    "tblog_hooks: attention= does not record flex_attention calls while another profile function "
                    "(sys.setprofile, a profiler) is set; they get no attention/* tag "
                    "(docs: attention.md#flexattention)",
                    RuntimeWarning,
                    stacklevel=5,
                )
            return
        sys.setprofile(self._profile)

    def stop(self) -> None:
        if sys.getprofile() is self._profile:
            sys.setprofile(None)

    def _event(self, frame: FrameType, event: str, arg: object) -> None:
        code = frame.f_code
        if event == "call" and code.co_name == "flex_attention" and code.co_filename == self._file:
            self.recorder.on_call(_flex, (), dict(frame.f_locals))


class _Enter(_Hook):
    """The model's forward pre-hook."""

    __slots__ = ("recorder",)

    def __init__(self, recorder: AttentionRecorder) -> None:
        self.recorder = recorder

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.recorder.enter(module)


class _Leave(_Enter):
    """The model's forward hook (``always_call=True``)."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any = None) -> None:
        self.recorder.leave()
