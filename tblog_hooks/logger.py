"""``HookLogger``: attach hooks to a model, log every N optimizer steps, detach on close."""

from __future__ import annotations

import difflib
import os
import sys
import tempfile
import warnings
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import NoReturn

import numpy as np
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.tensorboard import SummaryWriter

from . import amp
from .collect import Collector, Options
from .destination import Destination, is_closed
from .diagnose import Diagnostics
from .distributed import Ranks, is_sharded
from .errors import HookLoggerError
from .health import Finding, Thresholds
from .histograms import Histograms, schedule
from .hooks import ForwardHook, ForwardPreHook, Handles, OptimizerHooks, ParamGradHook, ours
from .records import Layout
from .selection import Selector, select_modules
from .summarize import StepSummary, summarize
from .transfer import Transfer
from .watched import Watched
from .write import use_fast_checksum

_OPTIONS = (
    "log_dir", "writer", "modules", "every", "activations", "gradients", "parameters",
    "histograms", "optimizer", "scaler", "eval_passes", "reduce_ranks", "inputs", "feature_maps", "health",
    "start_step", "prefix",
)  # fmt: skip


class HookLogger:
    """Log activation, gradient and parameter statistics of ``model`` to TensorBoard.

    Call :meth:`step` once per optimizer step; steps ``0, every, 2*every, ...`` are logged
    with that index as TensorBoard's ``global_step``. Use it as a context manager, or call
    :meth:`close`, to write what is pending and remove every hook; a logger dropped without
    :meth:`close` removes its hooks when it is garbage-collected.

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
        histograms: bool | int | Histograms = True,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scaler: torch.amp.GradScaler | None = None,
        eval_passes: bool = False,
        reduce_ranks: bool = False,
        inputs: bool = False,
        feature_maps: Selector | Sequence[Selector] | None = None,
        health: Thresholds | None = Thresholds(),  # noqa: B008 (immutable)
        start_step: int = 0,
        prefix: str | None = None,
        **unknown: NoReturn,
    ) -> None:
        if unknown:
            raise HookLoggerError(_unknown_options(unknown))
        if not isinstance(model, nn.Module):
            raise HookLoggerError(f"model must be an nn.Module, got {type(model).__name__}")
        _check_not_compiled(model)
        distributed = isinstance(model, nn.parallel.DistributedDataParallel)
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise HookLoggerError(f"every must be a positive int (log every N optimizer steps), got {every!r}")
        if writer is not None and log_dir is not None:
            raise HookLoggerError("pass either log_dir (the logger makes and closes a writer) or writer, not both")
        if not (activations or gradients or parameters):
            raise HookLoggerError(
                "activations, gradients and parameters are all False, so nothing would be logged; "
                "leave at least one of them True"
            )
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise HookLoggerError(
                f"start_step must be an int >= 0 (the index of the first step() call, e.g. the optimizer "
                f"steps a resumed run already made), got {start_step!r}"
            )
        if prefix is not None and (not isinstance(prefix, str) or not prefix.strip("/") or prefix.strip("/") != prefix):
            raise HookLoggerError(
                f"prefix must be a non-empty str without a leading or trailing '/' (tags become "
                f"'{{prefix}}/activation/...'; e.g. prefix='generator'), or None, got {prefix!r}"
            )
        if writer is not None:
            _check_writer(writer)
        _check_optimizers(optimizer)
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise HookLoggerError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
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
        options = Options(
            activations=activations,
            gradients=gradients,
            parameters=parameters,
            histograms=schedule(histograms),
            eval_passes=eval_passes,
            inputs=inputs,
            feature_maps=frozenset(mapped),
        )
        self._collector = Collector(options)
        self._handles = Handles()  # live until close()
        self._step_handles = Handles()  # live during one logged step
        self._pending: deque[tuple[int, Transfer, Layout]] = deque()  # logged steps on their way to the host
        self._step = start_step
        self._closed = False
        self._in_logged_step = False  # between _begin_logged_step and _end_logged_step
        self._module_names = tuple(selected)
        self._diagnostics = Diagnostics(self._module_names, self._collector.forward_order, health)
        self._watched = Watched(model, selected, parameters=parameters)
        params = self._watched.params()
        sharded = {key for key, p in params if is_sharded(p)}
        if optimizer is None and (sharded or (distributed and params)):
            raise HookLoggerError(
                f"got optimizer=None for a {'FSDP2' if sharded else 'DistributedDataParallel'} model, whose parameter "
                "gradients are final only when the optimizer steps: pass optimizer=your_optimizer, or parameters=False"
            )
        # With optimizer=, parameters are read when an optimizer steps them; else during backward.
        self._optimizer_hooks = (
            OptimizerHooks(self._collector, self._watched) if optimizer is not None and parameters else None
        )
        self._unstepped_warned = False
        self._amp = amp.ScaleWatch(scaler) if scaler is not None and scaler.is_enabled() else None
        self._ranks = Ranks(reduce=reduce_ranks, sharded=sharded)

        # Rank 0 writes; another rank only into a writer it was given.
        self._writer: SummaryWriter | None = writer
        owns_writer = writer is None and self._ranks.rank == 0
        if owns_writer:
            self._writer = _make_writer(log_dir, purge_step=start_step or None)
        self._destination = None if self._writer is None else Destination(self._writer, prefix)
        # Hooks, tensor hooks and an owned writer go when the logger is closed or collected.
        self._detach = weakref.finalize(
            self, _detach, self._handles, self._step_handles, self._collector, self._destination, owns_writer
        )
        _warn_if_shared(model, self._destination, self._destination is not None and self._destination.open())
        # Off: a rank that neither writes nor takes part in collectives; later, set once by _switch_off.
        self._off = self._writer is None and not self._ranks.needed
        use_fast_checksum()
        for name, module in selected.items():
            self._handles.add(module.register_forward_pre_hook(ForwardPreHook(self._collector, name), with_kwargs=True))
            self._handles.add(module.register_forward_hook(ForwardHook(self._collector, name)))
        self._collector.place_probes(model, selected)
        if self._optimizer_hooks is not None:
            self._handles.add(register_optimizer_step_pre_hook(self._optimizer_hooks.pre))
            self._handles.add(register_optimizer_step_post_hook(self._optimizer_hooks.post))
        if self._step % self.every == 0:
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
    def writer(self) -> SummaryWriter | None:
        """Where this process writes; ``None`` on a rank other than 0 given no ``writer=``."""
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
        if self._in_logged_step:
            if self._collector.active:
                self._check_stepped()  # not in close(): a step begun but not trained is no evidence
            self._end_logged_step()
        self._step += 1
        self._write(wait=False)
        if self._step % self.every == 0:
            self._begin_logged_step()

    def close(self) -> None:
        """Write everything pending, remove every hook, close the writer if the logger made it.
        Safe to call twice; afterwards the logger holds no reference to the model.

        Called while an exception propagates (a ``with`` block left by one, or ``close()`` in
        an ``except``/``finally``), it enters no collective: the other ranks may never reach
        theirs. A logged step that needs the other ranks is then dropped."""
        self._close(failing=sys.exc_info()[1] is not None)

    def _close(self, *, failing: bool) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._in_logged_step and failing and self._ranks.needed:
                self._in_logged_step = self._collector.active = False  # dropped, see close()
            elif self._in_logged_step:
                self._end_logged_step()
            self._write(wait=True)
            if self._destination is not None and not self._off:
                self._diagnostics.close(self._destination)
                self._destination.flush()
        except Exception as error:  # never raise out of close() over a broken writer
            self._switch_off("writing to TensorBoard", error)
        finally:
            self._watched.clear()
            try:
                self._detach()
            except Exception as error:  # closing a broken writer
                self._switch_off("closing the writer", error)

    def __enter__(self) -> HookLogger:
        if self._closed:
            raise HookLoggerError("with-block entered on a closed HookLogger; create a new HookLogger to log again")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close(failing=exc is not None)  # an exception handled around the block is not ours

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step={self._step}"
        return (
            f"HookLogger({len(self._module_names)} modules, {len(self._watched.params())} parameters, "
            f"every={self.every}, {state}, log_dir={self._writer.log_dir if self._writer else None!r})"
        )

    # -- internals ----------------------------------------------------------------------------
    def _begin_logged_step(self) -> None:
        # A rank that stopped logging still ends logged steps while the others expect it.
        self._in_logged_step = not self._off or self._ranks.needed
        if self._off:
            return
        self._collector.active = True
        self._collector.begin(self._step // self.every)
        if self._amp is not None:
            self._amp.begin()
        for name in self._watched.newly_left():
            self._collector.disabled.add(name)  # should it still be called from elsewhere
            warnings.warn(
                f"tblog_hooks: watched module {name!r} is no longer part of the model (replaced or deleted after the "
                "HookLogger was created), so it is not logged any more; create the HookLogger after changing the "
                "model to watch the new module",
                RuntimeWarning,
                stacklevel=3,
            )
        if self._optimizer_hooks is not None:
            return  # parameters are read when an optimizer steps them
        for key, p in self._watched.params():
            if p.requires_grad:  # a frozen parameter has no gradient (and takes no hook)
                self._step_handles.add(p.register_post_accumulate_grad_hook(ParamGradHook(self._collector, key)))

    def _check_stepped(self) -> None:
        """Warn once when, at the end of a logged step, a watched parameter holds a gradient that no
        optimizer stepped (one outside ``torch.optim``, or none), so it was not read. Not under an
        enabled scaler: a step it skips calls no optimizer at all."""
        if self._optimizer_hooks is None or self._unstepped_warned or self._amp is not None:
            return
        missed = self._optimizer_hooks.unstepped()
        if missed:
            self._unstepped_warned = True
            warnings.warn(
                f"tblog_hooks: {len(missed)} watched parameter(s) ({', '.join(map(repr, missed[:5]))}"
                f"{', ...' if len(missed) > 5 else ''}) have gradients but no torch.optim optimizer stepped them in "
                f"logged step {self._step}, so param_grad/* leaves them out (with optimizer=, gradients are read when "
                "an optimizer steps them); pass optimizer=None to read them during backward instead",
                RuntimeWarning,
                stacklevel=3,
            )

    def _end_logged_step(self) -> None:
        self._in_logged_step = self._collector.active = False
        self._collector.passes.reset()
        self._step_handles.remove_all()
        if self._optimizer_hooks is not None:
            self._optimizer_hooks.clear()
        packed = None
        try:
            self._collector.on_weights(self._watched.params)
            if self._amp is not None and not self._collector.empty:
                self._amp.finish(self._collector)
            packed = self._collector.finish()
        except Exception as error:  # e.g. histc under deterministic CUDA
            self._switch_off(f"packing step {self._step}", error)
        if self._ranks.needed:
            # Every rank takes part, even one that recorded nothing or stopped logging; if the
            # ranks' records cannot be combined, or a collective fails, every rank stops logging
            # (a warning each) instead of aborting or hanging in mismatched collectives.
            try:
                numels = self._ranks.agree(None if self._off else packed[1] if packed else Layout())
                packed = None if packed is None else self._ranks.combine(*packed, numels)
            except Exception as error:  # different calls on different ranks, a broken process group
                packed = None
                self._ranks.stop()
                self._switch_off(f"combining step {self._step} over ranks", error)
        if packed is not None and self._writer is not None and not self._off:
            self._pending.append((self._step, Transfer(packed[0]), packed[1]))

    def _write(self, *, wait: bool) -> None:
        """Write finished transfers in step order; with ``wait``, all of them."""
        while self._pending and (wait or self._pending[0][1].ready()):
            step, transfer, layout = self._pending.popleft()
            if self._off or self._destination is None:
                continue
            try:
                self._diagnostics.write(self._destination, self._summarize(step, transfer.result(), layout))
            except Exception as error:  # disk full, permission lost, a broken writer
                self._switch_off(f"writing step {step} to TensorBoard", error)

    def _summarize(self, step: int, values: np.ndarray, layout: Layout) -> StepSummary:
        """Host side of a logged step: decode (pooling the ranks' records), undo the AMP loss scale."""
        summary = summarize(step, values, layout)
        amp.unscale(summary, param_grads_scaled=self._optimizer_hooks is None)
        return summary

    def _switch_off(self, what: str, error: BaseException) -> None:
        """Stop all logging after a failure outside the hooks, warning once; training continues."""
        self._collector.active = False
        if self._off:
            return
        self._off = True
        warnings.warn(
            f"tblog_hooks: {what} failed, so logging is switched off (training continues; "
            f"log_dir={self._writer.log_dir if self._writer else None!r}): {type(error).__name__}: {error}",
            RuntimeWarning,
            stacklevel=4,
        )


def _check_optimizers(optimizer: object) -> None:
    """``optimizer=`` takes an optimizer, a non-empty list or tuple of them, or ``None``."""
    if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
        return
    items = optimizer if isinstance(optimizer, (list, tuple)) else None
    if items and all(isinstance(o, torch.optim.Optimizer) for o in items):
        return
    got = type(optimizer).__name__
    if items is not None:
        got += f" of {', '.join(type(o).__name__ for o in items) or 'nothing'}"
    raise HookLoggerError(
        f"optimizer must be a torch.optim.Optimizer, a non-empty list or tuple of them (a GAN's two) or None, got {got}"
    )


def _detach(
    handles: Handles, step_handles: Handles, collector: Collector, destination: Destination | None, owns_writer: bool
) -> None:
    """Remove every hook, stop recording, close an owned writer: the end of ``close()``, and what
    a logger garbage-collected without ``close()`` gets (``weakref.finalize``; holds no logger)."""
    handles.remove_all()
    step_handles.remove_all()
    collector.release()
    if destination is None:
        return
    destination.close()
    if owns_writer:
        destination.writer.close()


def _check_writer(writer: object) -> None:
    if not isinstance(writer, SummaryWriter):
        kind = type(writer)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise HookLoggerError(
            f"writer must be a torch.utils.tensorboard.SummaryWriter (or a subclass), got {name}; for another "
            "library's writer (tensorboardX, ...), pass log_dir= with its directory: the logger makes its own writer"
        )
    if is_closed(writer):
        raise HookLoggerError(
            f"writer= was closed (SummaryWriter.close(), log_dir={writer.get_logdir()!r}); writing to it would open "
            "a new event file: pass an open SummaryWriter, or log_dir="
        )


def _warn_if_shared(model: nn.Module, destination: Destination | None, same_tags: bool) -> None:
    """Warn once if another live logger writes the same tags here, or else watches this model."""
    if destination is not None and same_tags:
        where = f"{destination.directory!r}" + (f" with prefix={destination.prefix!r}" if destination.prefix else "")
        warnings.warn(
            f"tblog_hooks: another live HookLogger already writes into {where}: both write the same tags "
            "(activation/mean/0, ...) into one series. Give each logger its own prefix= (e.g. prefix='G' and "
            "prefix='D'), or close() the other logger first (re-ran a notebook cell? close the old logger)",
            UserWarning,
            stacklevel=3,
        )
    elif any(ours(hook) for m in model.modules() for hook in m._forward_hooks.values()):
        warnings.warn(
            "tblog_hooks: this model already carries the hooks of another live HookLogger, so both record on "
            "their logged steps; if a notebook cell was re-run, close() the old logger first (a logger dropped "
            "without close() removes its hooks once it is garbage-collected)",
            UserWarning,
            stacklevel=3,
        )


def _make_writer(log_dir: str | os.PathLike[str] | None, purge_step: int | None) -> SummaryWriter:
    try:
        if log_dir is not None and "://" not in os.fspath(log_dir):  # remote URLs are the writer's business
            # Probe first: a SummaryWriter that fails to create its file leaves its writer thread behind.
            os.makedirs(log_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=log_dir):
                pass
        return SummaryWriter(log_dir=None if log_dir is None else os.fspath(log_dir), purge_step=purge_step)
    except OSError as error:
        raise HookLoggerError(
            f"log_dir={log_dir!r} must be a directory this process can create files in: "
            f"{type(error).__name__}: {error}; pass a writable path, or writer=SummaryWriter(...)"
        ) from None


def _check_not_compiled(model: nn.Module) -> None:
    """Hooks added to a compiled model are not seen by code it already compiled."""
    compiled = (
        isinstance(model, torch._dynamo.eval_frame.OptimizedModule)
        or getattr(model, "_compiled_call_impl", None) is not None
    )
    if compiled:
        raise HookLoggerError(
            f"model is already compiled ({type(model).__name__}); hooks added now would be ignored by the compiled "
            "code: create the HookLogger first, then call torch.compile(model) or model.compile()"
        )


def _unknown_options(unknown: Mapping[str, object]) -> str:
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, _OPTIONS, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"HookLogger got unknown option(s) {', '.join(parts)}; valid options: {', '.join(_OPTIONS)}"


__all__ = ["HookLogger", "StepSummary"]
