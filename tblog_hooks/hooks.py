"""The hook callables the logger registers, and the one place their handles live.

Hooks hold the :class:`~tblog_hooks.collect.Collector` only, never the logger, the writer
or the model, so a forgotten logger does not keep a model alive. A ``copy.deepcopy`` or
pickle of the model (EMA, ``AveragedModel``, ``torch.save``) gets an inert hook instead of
a copy of ours: copies never log into this logger.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .collect import Collector


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
    """``register_forward_hook`` callable: statistics of the output on logged steps. Under
    ``torch.compile`` it returns the output passed through the module's probe (``probes.py``);
    otherwise ``None``, which keeps the output."""

    __slots__ = ()

    def __call__(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self.collector.active:
            return self.collector.on_output(self.name, output, module.training)
        return None


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


class OptimizerHook(_Inert):
    """``Optimizer.register_step_pre_hook`` callable: reads ``.grad`` right before the update,
    i.e. after gradient accumulation, DDP averaging and ``GradScaler.unscale_``, and copies
    the weights to measure the update."""

    __slots__ = ("collector", "params")

    def __init__(self, collector: Collector, params: list[tuple[str, Tensor]]) -> None:
        self.collector, self.params = collector, params

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.collector.active:
            self.collector.on_params(self.params)
            self.collector.before_update(self.params)


class OptimizerPostHook(_Inert):
    """``Optimizer.register_step_post_hook`` callable: the update-to-weight ratios."""

    __slots__ = ("collector",)

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.collector.active:
            self.collector.after_update()
