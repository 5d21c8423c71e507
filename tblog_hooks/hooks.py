"""The hook callables the logger registers, and the one place their handles live.

Hooks hold the :class:`~tblog_hooks.collect.Collector` (and the optimizer hooks the
weakly held :class:`~tblog_hooks.watched.Watched`), never the logger, the writer or the
model, so a forgotten logger does not keep a model alive. A ``copy.deepcopy`` or pickle of
the model (EMA, ``AveragedModel``, ``torch.save``) gets an inert hook instead of a copy of
ours: copies never log into this logger. The optimizer hooks are global ones, so no
optimizer (nor a copy or checkpoint of it) carries a hook of ours.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from . import amp
from .collect import Collector
from .watched import Watched


def inert_hook(*args: Any, **kwargs: Any) -> None:
    """What a copied model's (or optimizer's) hook becomes: it does nothing."""


def _inert() -> Callable[..., None]:
    # Rebuilds a copied hook as ``inert_hook`` itself (``__reduce__`` calls what it returns).
    return inert_hook


class _Inert:
    """Copies and pickles of a hook (``copy.deepcopy``, ``AveragedModel``, ``torch.save``)
    become :func:`inert_hook`: they never log into this logger or copy its state."""

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        return _inert, ()


class _Hook(_Inert):
    __slots__ = ("collector", "name")

    def __init__(self, collector: Collector, name: str) -> None:
        self.collector, self.name = collector, name


class ForwardHook(_Hook):
    """``register_forward_hook`` callable: statistics of the output on logged steps."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.collector.active:
            self.collector.on_output(self.name, output, module.training)


class ForwardPreHook(_Hook):
    """``register_forward_pre_hook`` callable (with kwargs): input statistics on logged steps."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, kwargs: Any) -> None:
        if self.collector.active:
            self.collector.on_input(self.name, (args, kwargs), module.training)


class ParamGradHook(_Hook):
    """``register_post_accumulate_grad_hook`` callable: sees each ``.grad`` once accumulated."""

    __slots__ = ()

    def __call__(self, param: Tensor) -> None:
        self.collector.on_params([(self.name, param)])


class Handles:
    """Every handle the logger made, removed in one place; ``remove_all`` is idempotent."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def add(self, handle: RemovableHandle) -> None:
        self._handles.append(handle)

    def remove_all(self) -> None:
        while self._handles:
            self._handles.pop().remove()

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
