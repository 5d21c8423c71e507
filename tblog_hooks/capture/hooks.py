"""The hook callables the logger registers (their base and handles: ``watched.py``).

Hooks hold their recorder (``activations.py``, ``parameters.py``), never the logger, the writer or
the model, so a forgotten logger does not keep a model alive. Copies and pickles of a model
(``copy.deepcopy``, EMA, ``AveragedModel``, ``torch.save``) leave out our module hooks
(``watched.LeftOut``); parameters and tensors are copied and pickled without their hooks by torch
itself, and the optimizer hooks are global ones, so no copy or checkpoint of a model or of an
optimizer carries a hook of ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from .step import StepBuffer
from .watched import _Hook

if TYPE_CHECKING:
    from .activations import ActivationRecorder
    from .parameters import ParameterRecorder


class _ModuleHook(_Hook):
    """A module hook of one watched module; does nothing between logged steps."""

    __slots__ = ("buffer", "name", "recorder")

    def __init__(self, recorder: ActivationRecorder, name: str) -> None:
        self.recorder, self.buffer, self.name = recorder, recorder.buffer, name


class ForwardHook(_ModuleHook):
    """``register_forward_hook`` callable: statistics of the output on logged steps. Under
    ``torch.compile`` it returns the output passed through the module's probe (``probes.py``);
    otherwise ``None``, which keeps the output."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.buffer.active:
            return self.recorder.on_output(self.name, module, args, output)
        return None


class ForwardPreHook(_ModuleHook):
    """``register_forward_pre_hook`` callable (with kwargs): input statistics on logged steps."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.buffer.active:
            self.recorder.on_input(self.name, module, (args, kwargs))


class ParamGradHook:
    """``register_post_accumulate_grad_hook`` callable: sees each ``.grad`` once accumulated
    (registered for one logged step at a time)."""

    __slots__ = ("name", "recorder")

    def __init__(self, recorder: ParameterRecorder, name: str) -> None:
        self.recorder, self.name = recorder, name

    def __call__(self, param: Tensor) -> None:
        self.recorder.on_param_grad(self.name, param)


class KeepTraced:
    """``register_post_accumulate_grad_hook`` callable on one trained parameter, for a logged step
    whose backward runs no other hook of ours: copies compiled hooks' records out of CUDA graph
    memory (``StepBuffer.keep_traced``) before the next micro-batch's forward, and tells that the
    step trained (``StepBuffer.trained``)."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: StepBuffer) -> None:
        self.buffer = buffer

    def __call__(self, param: Tensor) -> None:
        self.buffer.trained = True
        self.buffer.keep_traced()


class PlacementHook(_Hook):
    """A module hook that follows how tensor-parallel data is placed (``topology/parallel.py``)."""

    __slots__ = ("follow",)

    def __init__(self, follow: Callable[..., None]) -> None:
        self.follow = follow

    def __call__(self, *args: Any) -> None:
        self.follow(*args)
