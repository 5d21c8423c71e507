"""``HookLogger``: attach hooks to a model, log every N optimizer steps, detach on close."""

from __future__ import annotations

import difflib
import os
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import NoReturn

import torch
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from .collect import Collector, Layout, Options
from .diagnose import Diagnostics
from .errors import HookLoggerError
from .health import Finding, Thresholds
from .hooks import ForwardHook, ForwardPreHook, Handles, OptimizerHook, OptimizerPostHook, ParamGradHook
from .selection import Selector, select_modules
from .summarize import StepSummary, summarize
from .transfer import Transfer
from .write import use_fast_checksum

_OPTIONS = (
    "log_dir", "writer", "modules", "every", "activations", "gradients", "parameters",
    "histograms", "optimizer", "inputs", "feature_maps", "health",
)  # fmt: skip


class HookLogger:
    """Log activation, gradient and parameter statistics of ``model`` to TensorBoard.

    Call :meth:`step` once per optimizer step; steps ``0, every, 2*every, ...`` are logged
    with that index as TensorBoard's ``global_step``. Use it as a context manager, or call
    :meth:`close`, to write what is pending and remove every hook.

    >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    >>> with HookLogger(model, log_dir=tmp, every=10) as hooks:  # doctest: +SKIP
    ...     for x, y in batches:
    ...         loss = (model(x) - y).pow(2).mean(); loss.backward()
    ...         opt.step(); opt.zero_grad(); hooks.step()
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        writer: SummaryWriter | None = None,
        modules: Selector | Sequence[Selector] | None = None,
        every: int = 100,
        activations: bool = True,
        gradients: bool = True,
        parameters: bool = True,
        histograms: bool = True,
        optimizer: torch.optim.Optimizer | None = None,
        inputs: bool = False,
        feature_maps: Selector | Sequence[Selector] | None = None,
        health: Thresholds | None = Thresholds(),  # noqa: B008 (immutable)
        **unknown: NoReturn,
    ) -> None:
        if unknown:
            raise HookLoggerError(_unknown_options(unknown))
        if not isinstance(model, nn.Module):
            raise HookLoggerError(f"model must be an nn.Module, got {type(model).__name__}")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise HookLoggerError(f"every must be a positive int (log every N optimizer steps), got {every!r}")
        if writer is not None and log_dir is not None:
            raise HookLoggerError("pass either log_dir (the logger makes and closes a writer) or writer, not both")
        if writer is not None and not isinstance(writer, SummaryWriter):
            raise HookLoggerError(
                f"writer must be a torch.utils.tensorboard.SummaryWriter, got {type(writer).__name__}"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise HookLoggerError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if health is not None and not isinstance(health, Thresholds):
            raise HookLoggerError(
                f"health must be a tblog_hooks.Thresholds (or None to switch findings off), got {health!r}"
            )

        selected = select_modules(model, modules)
        try:
            mapped = {} if feature_maps is None else select_modules(model, feature_maps)
        except HookLoggerError as error:
            raise HookLoggerError(f"feature_maps= (same selectors as modules=): {error}") from None
        if set(mapped) - set(selected):
            raise HookLoggerError(
                f"feature_maps= selects modules that are not watched: {sorted(set(mapped) - set(selected))!r}; "
                "add them to modules= as well"
            )
        self.every = every
        options = Options(activations, gradients, parameters, histograms, inputs, frozenset(mapped))
        self._collector = Collector(options)
        self._handles = Handles()  # live until close()
        self._step_handles = Handles()  # live during one logged step
        self._pending: deque[tuple[int, Transfer, Layout]] = deque()
        self._step = 0
        self._closed = False
        self._write_failed = False
        self._module_names = tuple(selected)
        self._diagnostics = Diagnostics(self._module_names, self._collector.forward_order, health)
        self._params: list[tuple[str, Tensor]] = []
        if parameters:
            seen: set[int] = set()
            for name, module in selected.items():
                for pname, p in module.named_parameters(recurse=False):
                    if p.requires_grad and id(p) not in seen:
                        seen.add(id(p))
                        self._params.append((f"{name}.{pname}", p))
        self._use_optimizer = optimizer is not None

        self._writer, self._owns_writer = writer or _make_writer(log_dir), writer is None
        use_fast_checksum()
        for name, module in selected.items():
            self._handles.add(module.register_forward_pre_hook(ForwardPreHook(self._collector, name), with_kwargs=True))
            self._handles.add(module.register_forward_hook(ForwardHook(self._collector, name)))
        if optimizer is not None and self._params:
            self._handles.add(optimizer.register_step_pre_hook(OptimizerHook(self._collector, self._params)))
            self._handles.add(optimizer.register_step_post_hook(OptimizerPostHook(self._collector)))
        self._begin_logged_step()

    # -- public API -------------------------------------------------------------------------
    @property
    def module_names(self) -> tuple[str, ...]:
        """Names of the watched modules, in ``model.named_modules()`` order."""
        return self._module_names

    @property
    def global_step(self) -> int:
        """Index of the current optimizer step (the number of :meth:`step` calls so far)."""
        return self._step

    @property
    def writer(self) -> SummaryWriter:
        return self._writer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def findings(self) -> list[Finding]:
        """Every finding that started so far, in order (empty with ``health=None``)."""
        health = self._diagnostics.health
        return [] if health is None else list(health.started)

    def summary(self) -> dict[str, float]:
        """Numbers for a progress bar (``tqdm.set_postfix(**hooks.summary())``) from the latest
        *written* step: ``grad_norm`` (global parameter-gradient norm), ``min_layer_grad``
        (smallest output-gradient norm of a watched module), ``findings`` (how many hold now).
        On the CPU a logged step is written by its ``step()``; on CUDA once its copy to the
        host has completed, at a later ``step()`` or ``close()``."""
        return self._diagnostics.summary()

    def step(self) -> None:
        """Mark the end of one optimizer step; logs it if its index is a multiple of ``every``."""
        if self._closed:
            raise HookLoggerError("step() called after close(); create a new HookLogger to log again")
        if self._collector.active:
            self._end_logged_step()
        self._step += 1
        self._write(wait=False)
        if self._step % self.every == 0:
            self._begin_logged_step()

    def close(self) -> None:
        """Write everything pending, remove every hook, close the writer if the logger made it.
        Safe to call twice; afterwards the logger holds no reference to the model."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._collector.active:
                self._end_logged_step()
            self._write(wait=True)
        finally:
            self._handles.remove_all()
            self._step_handles.remove_all()
            self._collector.remove_tensor_hooks()
            self._params = []
            try:
                self._writer.flush()
                if self._owns_writer:
                    self._writer.close()
            except Exception as error:  # never raise out of close() over a broken writer
                self._warn_write_failure(error)

    def __enter__(self) -> HookLogger:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step={self._step}"
        return (
            f"HookLogger({len(self._module_names)} modules, {len(self._params)} parameters, "
            f"every={self.every}, {state}, log_dir={self._writer.log_dir!r})"
        )

    # -- internals ----------------------------------------------------------------------------
    def _begin_logged_step(self) -> None:
        self._collector.active = True
        if not self._use_optimizer:
            for key, p in self._params:
                self._step_handles.add(p.register_post_accumulate_grad_hook(ParamGradHook(self._collector, key)))

    def _end_logged_step(self) -> None:
        self._collector.active = False
        self._step_handles.remove_all()
        packed = self._collector.finish()
        if packed is not None:
            self._pending.append((self._step, Transfer(packed[0]), packed[1]))

    def _write(self, *, wait: bool) -> None:
        """Write finished transfers in step order; with ``wait``, all of them."""
        while self._pending and (wait or self._pending[0][1].ready()):
            step, transfer, layout = self._pending.popleft()
            if self._write_failed:
                continue
            try:
                self._diagnostics.write(self._writer, summarize(step, transfer.result(), layout))
            except Exception as error:
                self._write_failed = True
                self._warn_write_failure(error)

    def _warn_write_failure(self, error: BaseException) -> None:
        warnings.warn(
            f"tblog_hooks: writing to TensorBoard failed and is switched off "
            f"(training continues): {type(error).__name__}: {error}",
            RuntimeWarning,
            stacklevel=3,
        )


def _make_writer(log_dir: str | os.PathLike[str] | None) -> SummaryWriter:
    try:
        return SummaryWriter(log_dir=None if log_dir is None else os.fspath(log_dir))
    except OSError as error:
        raise HookLoggerError(f"cannot write TensorBoard events to log_dir={log_dir!r}: {error}") from None


def _unknown_options(unknown: Mapping[str, object]) -> str:
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, _OPTIONS, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"HookLogger got unknown option(s) {', '.join(parts)}; valid options: {', '.join(_OPTIONS)}"


__all__ = ["HookLogger", "StepSummary"]
