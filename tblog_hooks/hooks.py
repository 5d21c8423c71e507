"""The hook callables the logger registers, and the one place their handles live.

Hooks hold the :class:`~tblog_hooks.collect.Collector` (and the optimizer hooks the
weakly held :class:`~tblog_hooks.watched.Watched`), never the logger, the writer or the
model, so a forgotten logger does not keep a model alive. Copies and pickles of a model
(``copy.deepcopy``, EMA, ``AveragedModel``, ``torch.save``) get :data:`NOOP` in place of each
of our hooks: they never log into the logger and reference nothing of this library, so a
checkpoint loads where it is not installed. The entries of a deep copy are also removed when
the logger's hooks are. The optimizer hooks are global ones, so no optimizer (nor a copy or
checkpoint of it) carries a hook of ours.
"""

from __future__ import annotations

import enum
import sys
import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from . import amp
from .collect import Collector
from .watched import Watched

# What a copied or unpickled hook is: a standard-library callable that takes any arguments and
# returns None (a hook returning None changes nothing). ``Enum.__init__`` is ``def __init__(self,
# *args, **kwds): pass`` from Python 3.11 on, which torch.compile traces; ``None.__init__`` (a
# built-in, before 3.11) does the same but is a graph break under torch.compile.
_NOOP_SOURCE: tuple[object, str] = (enum.Enum, "__init__") if sys.version_info >= (3, 11) else (None, "__init__")
NOOP: Callable[..., None] = getattr(*_NOOP_SOURCE)


class _Hook:
    """Base of our hooks: copies and pickles become :data:`NOOP` (see the module docstring).
    ``handle`` and ``handles`` are set by :meth:`Handles.add`."""

    __slots__ = ("collector", "handle", "handles")

    def __init__(self, collector: Collector) -> None:
        self.collector = collector
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


class _NamedHook(_Hook):
    __slots__ = ("name",)

    def __init__(self, collector: Collector, name: str) -> None:
        super().__init__(collector)
        self.name = name


class ForwardHook(_NamedHook):
    """``register_forward_hook`` callable: statistics of the output on logged steps. Under
    ``torch.compile`` it returns the output passed through the module's probe (``probes.py``);
    otherwise ``None``, which keeps the output."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.collector.active:
            return self.collector.on_output(self.name, output, module.training)
        return None


class ForwardPreHook(_NamedHook):
    """``register_forward_pre_hook`` callable (with kwargs): input statistics on logged steps."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.collector.active:
            self.collector.on_input(self.name, (args, kwargs), module.training)


class ParamGradHook(_NamedHook):
    """``register_post_accumulate_grad_hook`` callable: sees each ``.grad`` once accumulated."""

    __slots__ = ()

    def __call__(self, param: Tensor) -> None:
        self.collector.on_param_grad(self.name, param)


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


#: The name under which a failure of the optimizer hooks is reported (and they stop).
_OPTIMIZER_HOOKS = "parameters"


class OptimizerHooks:
    """Step pre- and post-hook of every optimizer (``register_optimizer_step_pre_hook`` and
    ``_post_hook`` of ``torch.optim.optimizer``): on a logged step, the watched parameters an
    optimizer steps are read when it steps them — after gradient accumulation, DDP averaging
    and ``GradScaler.unscale_`` — so each is read by its own optimizer (a GAN's two; one that
    replaced the optimizer given), and one no optimizer steps is not read. The weights are
    copied before the step to measure the update."""

    __slots__ = ("_params", "_stepped", "_stepping", "collector", "watched")

    def __init__(self, collector: Collector, watched: Watched) -> None:
        self.collector, self.watched = collector, watched
        # This logged step's watched parameters by id, looked up at its first optimizer step
        # (so parameters replaced just before it are read); None until then and between logged steps.
        self._params: dict[int, tuple[str, Tensor]] | None = None
        self._stepped: set[str] = set()  # keys an optimizer stepped this logged step
        # id(optimizer) -> (its watched parameters, whether to read them after its step), during its step.
        self._stepping: dict[int, tuple[list[tuple[str, Tensor]], bool]] = {}

    def pre(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        if not self.collector.active or _OPTIMIZER_HOOKS in self.collector.disabled:
            return
        try:
            params = self._params  # one read: another thread's optimizer may run this hook too
            if params is None:
                params = self._params = {id(p): (key, p) for key, p in self.watched.params()}
            named = [entry for group in optimizer.param_groups for p in group["params"] if (entry := params.get(id(p)))]
            if not named:
                return  # another model's optimizer
            # LBFGS & co. compute gradients inside step(), by calling the closure: read them after it.
            closure = kwargs.get("closure", args[1] if len(args) > 1 else None)  # args[0] is the optimizer
            if closure is None:
                self._read(named, amp.grad_scale(optimizer))
            self._stepping[id(optimizer)] = (named, closure is not None)
            self.collector.before_update([(key, p) for key, p in named if p.requires_grad])
        except Exception as error:  # the logger must never stop training
            self.collector.fail(_OPTIMIZER_HOOKS, error)

    def post(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        stepping = self._stepping.pop(id(optimizer), None)
        if stepping is None:
            return
        try:
            named, read_after = stepping
            if read_after:
                self._read(named, None)
            self.collector.after_update()
        except Exception as error:
            self.collector.fail(_OPTIMIZER_HOOKS, error)

    def _read(self, named: list[tuple[str, Tensor]], scale: Tensor | None) -> None:
        self.collector.on_params(named, scale=scale)
        self._stepped.update(key for key, _ in named)

    def unstepped(self) -> list[str]:
        """Watched parameters holding a gradient that no optimizer stepped this logged step
        (none when these hooks failed: nothing was read then)."""
        if _OPTIMIZER_HOOKS in self.collector.disabled:
            return []
        params = self.watched.params()
        return [key for key, p in params if key not in self._stepped and p.requires_grad and p.grad is not None]

    def clear(self) -> None:
        """End of a logged step: hold no parameter until the next one."""
        self._params, self._stepped = None, set()
        self._stepping.clear()


def ours(hook: object) -> bool:
    """Whether ``hook`` (a value of a module's hooks dict) is one of this library's."""
    return isinstance(hook, _Hook)
