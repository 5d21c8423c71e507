"""``HookLogger``: attach hooks to a model, log every N optimizer steps, detach on close."""

from __future__ import annotations

import difflib
import os
import tempfile
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import NoReturn

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from . import amp
from .collect import Collector, Options
from .diagnose import Diagnostics
from .distributed import Ranks, is_sharded, merge_ranks
from .errors import HookLoggerError
from .health import Finding, Thresholds
from .histograms import Histograms, schedule
from .hooks import ForwardHook, ForwardPreHook, Handles, OptimizerHook, OptimizerPostHook, ParamGradHook
from .records import Layout
from .selection import Selector, select_modules
from .summarize import StepSummary, summarize
from .transfer import Transfer
from .write import use_fast_checksum

_OPTIONS = (
    "log_dir", "writer", "modules", "every", "activations", "gradients", "parameters",
    "histograms", "optimizer", "scaler", "eval_passes", "reduce_ranks", "inputs", "feature_maps", "health",
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
        histograms: bool | int | Histograms = True,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
        eval_passes: bool = False,
        reduce_ranks: bool = False,
        inputs: bool = False,
        feature_maps: Selector | Sequence[Selector] | None = None,
        health: Thresholds | None = Thresholds(),  # noqa: B008 (immutable)
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
        if writer is not None and not isinstance(writer, SummaryWriter):
            raise HookLoggerError(
                f"writer must be a torch.utils.tensorboard.SummaryWriter, got {type(writer).__name__}"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise HookLoggerError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
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
        self._step = 0
        self._closed = False
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
        sharded = {key for key, p in self._params if is_sharded(p)}
        if optimizer is None and (sharded or (distributed and self._params)):
            raise HookLoggerError(
                f"got optimizer=None for a {'FSDP2' if sharded else 'DistributedDataParallel'} model, whose parameter "
                "gradients are final only when the optimizer steps: pass optimizer=your_optimizer, or parameters=False"
            )
        self._use_optimizer = optimizer is not None
        self._amp = amp.ScaleWatch(scaler) if scaler is not None and scaler.is_enabled() else None
        self._ranks = Ranks(reduce=reduce_ranks, sharded=sharded)

        # Rank 0 writes; another rank only into a writer it was given.
        self._writer: SummaryWriter | None = writer
        self._owns_writer = writer is None and self._ranks.rank == 0
        if self._owns_writer:
            self._writer = _make_writer(log_dir)
        # Off: a rank that neither writes nor takes part in collectives; later, set once by _switch_off.
        self._off = self._writer is None and not self._ranks.needed
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
            if self._writer is not None and not self._off:
                self._diagnostics.close(self._writer)
        finally:
            self._handles.remove_all()
            self._step_handles.remove_all()
            self._collector.remove_tensor_hooks()
            self._params = []
            try:
                if self._writer is not None:
                    self._writer.flush()
                    if self._owns_writer:
                        self._writer.close()
            except Exception as error:  # never raise out of close() over a broken writer
                self._switch_off("writing to TensorBoard", error)

    def __enter__(self) -> HookLogger:
        if self._closed:
            raise HookLoggerError("with-block entered on a closed HookLogger; create a new HookLogger to log again")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"step={self._step}"
        return (
            f"HookLogger({len(self._module_names)} modules, {len(self._params)} parameters, "
            f"every={self.every}, {state}, log_dir={self._writer.log_dir if self._writer else None!r})"
        )

    # -- internals ----------------------------------------------------------------------------
    def _begin_logged_step(self) -> None:
        if self._off:
            return
        self._collector.active = True
        self._collector.begin(self._step // self.every)
        if self._amp is not None:
            self._amp.begin()
        if not self._use_optimizer:
            for key, p in self._params:
                if p.requires_grad:  # a layer frozen mid-training has no gradient (and takes no hook)
                    self._step_handles.add(p.register_post_accumulate_grad_hook(ParamGradHook(self._collector, key)))

    def _end_logged_step(self) -> None:
        self._collector.active = False
        self._collector.passes.reset()
        self._step_handles.remove_all()
        try:
            self._collector.on_weights(self._params)
            if self._amp is not None and not self._collector.empty:
                self._amp.finish(self._collector)
            packed = self._collector.finish()
            if packed is None:
                return
            values, layout = packed
            if self._ranks.needed:
                values = self._ranks.combine(values, layout)
            if self._writer is not None:
                self._pending.append((self._step, Transfer(values), layout))
        except Exception as error:  # e.g. histc under deterministic CUDA, a broken process group
            self._switch_off(f"packing step {self._step}", error)

    def _write(self, *, wait: bool) -> None:
        """Write finished transfers in step order; with ``wait``, all of them."""
        while self._pending and (wait or self._pending[0][1].ready()):
            step, transfer, layout = self._pending.popleft()
            if self._off or self._writer is None:
                continue
            try:
                self._diagnostics.write(self._writer, self._summarize(step, transfer.result(), layout))
            except Exception as error:  # disk full, permission lost, a broken writer
                self._switch_off(f"writing step {step} to TensorBoard", error)

    def _summarize(self, step: int, values: np.ndarray, layout: Layout) -> StepSummary:
        """Host side of a logged step: pool the ranks' records, decode, undo the AMP loss scale."""
        if values.ndim == 2:
            values, layout = merge_ranks(values, layout)
        summary = summarize(step, values, layout)
        amp.unscale(summary, param_grads_scaled=not self._use_optimizer)
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


def _make_writer(log_dir: str | os.PathLike[str] | None) -> SummaryWriter:
    try:
        if log_dir is not None and "://" not in os.fspath(log_dir):  # remote URLs are the writer's business
            # Probe first: a SummaryWriter that fails to create its file leaves its writer thread behind.
            os.makedirs(log_dir, exist_ok=True)
            with tempfile.TemporaryFile(dir=log_dir):
                pass
        return SummaryWriter(log_dir=None if log_dir is None else os.fspath(log_dir))
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
