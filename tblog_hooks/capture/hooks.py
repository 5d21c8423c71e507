"""The hook callables the logger registers, and the one place their handles live.

Hooks hold their recorder (``activations.py``, ``parameters.py``), never the logger, the writer or
the model, so a forgotten logger does not keep a model alive. Copies and pickles of a model
(``copy.deepcopy``, EMA, ``AveragedModel``, ``torch.save``) get :data:`NOOP` in place of each
of our hooks: they never log into the logger and reference nothing of this library, so a
checkpoint loads where it is not installed. The entries of a deep copy are also removed when
the logger's hooks are. The optimizer hooks are global ones, so no optimizer (nor a copy or
checkpoint of it) carries a hook of ours.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .step import StepBuffer

if TYPE_CHECKING:
    from .activations import ActivationRecorder
    from .parameters import ParameterRecorder

# What a copied or unpickled hook is: a standard-library callable that takes any arguments and
# returns None (a hook returning None changes nothing), and that torch.compile traces:
# ``Enum.__init__`` is ``def __init__(self, *args, **kwds): pass``.
_NOOP_SOURCE: tuple[object, str] = (enum.Enum, "__init__")
NOOP: Callable[..., None] = getattr(*_NOOP_SOURCE)


class _Hook:
    """Base of our hooks: copies and pickles become :data:`NOOP` (see the module docstring).
    ``handle`` and ``handles`` are set by :meth:`Handles.add`."""

    __slots__ = ("handle", "handles")

    def __init__(self) -> None:
        self.handle: RemovableHandle | None = None
        self.handles: Handles | None = None

    def __reduce__(self) -> tuple[Any, tuple[object, str]]:
        return getattr, _NOOP_SOURCE

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        # ``copy.deepcopy`` copies a hooks dict into memo before its entries: find the copy of
        # ours and let ``Handles.remove_all`` take the entry out of it too.
        if self.handle is not None and self.handles is not None:
            original = self.handle.hooks_dict_ref()
            copied = None if original is None else memo.get(id(original))
            if copied is not None:
                self.handles.copied(copied, self.handle.id)
        return NOOP


class _ModuleHook(_Hook):
    """A module hook of one watched module; does nothing between logged steps."""

    __slots__ = ("buffer", "name", "recorder")

    def __init__(self, recorder: ActivationRecorder, name: str) -> None:
        super().__init__()
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
            self.recorder.on_input(self.name, (args, kwargs), module.training)


class ParamGradHook(_Hook):
    """``register_post_accumulate_grad_hook`` callable: sees each ``.grad`` once accumulated
    (registered for one logged step at a time)."""

    __slots__ = ("name", "recorder")

    def __init__(self, recorder: ParameterRecorder, name: str) -> None:
        super().__init__()
        self.recorder, self.name = recorder, name

    def __call__(self, param: Tensor) -> None:
        self.recorder.on_param_grad(self.name, param)


class KeepTraced(_Hook):
    """``register_post_accumulate_grad_hook`` callable on one trained parameter, for a logged step
    whose backward runs no other hook of ours: copies compiled hooks' records out of CUDA graph
    memory (``StepBuffer.keep_traced``) before the next micro-batch's forward."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: StepBuffer) -> None:
        super().__init__()
        self.buffer = buffer

    def __call__(self, param: Tensor) -> None:
        self.buffer.keep_traced()


class PlacementHook(_Hook):
    """A module hook that follows how tensor-parallel data is placed (``topology/parallel.py``)."""

    __slots__ = ("follow",)

    def __init__(self, follow: Callable[..., None]) -> None:
        super().__init__()
        self.follow = follow

    def __call__(self, *args: Any) -> None:
        self.follow(*args)


class Handles:
    """Every handle the logger made, and every entry deep copies made of its hooks, removed
    in one place; ``remove_all`` is idempotent. Holds no hook dict, only weak references."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []
        self._copies: dict[int, tuple[weakref.ref[dict[int, Any]], list[int]]] = {}  # id(dict) -> dict, keys

    def add(self, handle: RemovableHandle) -> None:
        """Keep ``handle``; the hook it registered learns it, to find the entries of its deep copies."""
        self._handles.append(handle)
        hooks_dict = handle.hooks_dict_ref()
        hook = None if hooks_dict is None else hooks_dict.get(handle.id)
        if isinstance(hook, _Hook):
            hook.handle, hook.handles = handle, self

    def copied(self, hooks_dict: dict[int, Any], key: int) -> None:
        """A deep copy of one of our hooks is going into ``hooks_dict[key]``."""
        entry = self._copies.get(id(hooks_dict))
        if entry is None or entry[0]() is not hooks_dict:
            # A new copied dict: forget copies already collected, so repeated deep copies do not pile up.
            self._copies = {i: e for i, e in self._copies.items() if e[0]() is not None}
            entry = self._copies[id(hooks_dict)] = (weakref.ref(hooks_dict), [])
        entry[1].append(key)

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()
        while self._copies:
            ref, keys = self._copies.popitem()[1]
            hooks_dict = ref()
            if hooks_dict is not None:
                for key in keys:
                    hooks_dict.pop(key, None)

    def __len__(self) -> int:
        return len(self._handles)


def ours(hook: object) -> bool:
    """Whether ``hook`` (a value of a module's hooks dict) is one of this library's."""
    return isinstance(hook, _Hook)
