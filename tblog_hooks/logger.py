"""``HookLogger``: attach hooks to a model, log every N optimizer steps, detach on close."""

from __future__ import annotations

import enum
import functools
import os
import sys
import tempfile
import warnings
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any

from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

from ._compat import compiled_code_ran, fast_checksum, forward_hooks, is_compiled
from .capture.recording import Recording, ScaleWatch
from .capture.selection import named_modules, select_modules
from .capture.watched import Watched, ours
from .diagnostics.findings import Finding
from .diagnostics.per_step import Diagnostics
from .errors import HookLoggerError
from .keywords import is_off
from .options import Options, check_names, logger_signature
from .output.destination import Destination
from .output.event_files import frame
from .output.outbox import Outbox, WriteError
from .spike_log import SpikeLog
from .topology.parallel import TensorParallel
from .transport.distributed import Ranks, gradient_divisor, rank_and_world


class _State(enum.Enum):
    """Where a logger is in its steps."""

    IDLE = "between logged steps"
    RECORDING = "in a logged step, its hooks recording"
    #: In a logged step this rank records nothing in (logging is off here) but whose collectives
    #: it joins, because the other ranks expect it.
    JOINING = "in a logged step, joining its collectives only"
    OFF = "logging switched off"
    CLOSED = "closed"

    @property
    def in_step(self) -> bool:
        return self in (_State.RECORDING, _State.JOINING)

    @property
    def off(self) -> bool:
        return self in (_State.OFF, _State.JOINING)


class HookLogger:
    """Log activation, gradient and parameter statistics of ``model`` to TensorBoard.

    Call :meth:`step` once per optimizer step; steps ``0, every, 2*every, ...`` are logged with that index as
    TensorBoard's ``global_step``. Use it as a context manager, or call :meth:`close`, to write what is pending
    and remove every hook; a logger dropped without :meth:`close` removes its hooks when it is garbage-collected.

    Args:
        model: the ``nn.Module`` to watch (a ``DistributedDataParallel`` wrapper is unwrapped to
            ``.module``). Attach before ``torch.compile(model)`` / ``model.compile()``.
        **options: the fields of :class:`~tblog_hooks.options.Options` (``log_dir``, ``writer``,
            ``modules``, ``every``, ...), all keyword-only: the signature ``help()``, editors and
            mypy see is made from those fields.

    Raises:
        HookLoggerError: at construction, for bad options (saying what was wrong, the value and
            what is valid), a compiled model, or selectors that match nothing; and for
            :meth:`step` or a ``with`` block after :meth:`close`.

    Example:
        >>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        >>> with HookLogger(model, log_dir=tmp, every=10) as hooks:  # doctest: +SKIP
        ...     for x, y in batches:
        ...         loss = (model(x) - y).pow(2).mean(); loss.backward()
        ...         opt.step(); opt.zero_grad(); hooks.step()
    """

    @logger_signature(Options)
    def __init__(self, model: nn.Module, **options: Any) -> None:
        check_names(options)
        wrapper = model
        model, averaged = _model_to_watch(model)
        config = Options(**options)
        selected, mapped, logits = _select(model, config)
        self._every = config.every
        self._step = config.start_step
        # Logged steps that recorded something: the histogram schedule counts these, so the first one a loop
        # trains in has histograms (a framework callback's first logged step, 0, ends before it steps).
        self._recorded_steps = 0
        self._module_names = tuple(selected)
        self._watched = Watched(model, selected)
        parallel = _tensor_parallel(model, selected)
        split = parallel.holds_split()
        self._recording = Recording(
            self._watched, config, feature_maps=frozenset(mapped), logits=logits, model=model, parallel=parallel
        )
        _check_optimizer(config, averaged=averaged, split=split, graded=bool(self._recording.counted()))
        self._amp = ScaleWatch(config.scaler) if config.scaler is not None and config.scaler.is_enabled() else None
        self._ranks = Ranks(reduce=config.reduce_ranks, split=split, first=parallel.first_of_group())
        self._diagnostics = Diagnostics(self._module_names, self._recording.forward_order, config.thresholds)
        # Rank 0 writes, into writer= or a writer of its own; another rank only into a writer it was given.
        self._writer, owns_writer = _open_writer(config, self._ranks.rank)
        self._destination = None if self._writer is None else Destination(self._writer, config.prefix)
        restore = None if self._writer is None else fast_checksum(self._writer, frame)
        self._detach = weakref.finalize(self, _detach, self._recording, self._destination, owns_writer, restore)
        divisor = gradient_divisor(wrapper, model)
        self._outbox = _outbox(self._destination, self._diagnostics, self._recording, divisor)
        _warn_if_shared(model, self._destination)
        spiking = (self._recording.handles, self._diagnostics, self._destination, self._ranks, model, divisor)
        closures = self._recording.optimizer_steps.every_step
        self._spikes = SpikeLog.of(config, self._watched, self._module_names, *spiking, closures=closures)
        # A rank that neither writes nor takes part in collectives is off from the start.
        self._state = _State.OFF if self._writer is None and not self._ranks.needed else _State.IDLE
        self._recording.attach(model, selected)
        if self._step % self._every == 0:
            self._begin_logged_step()

    # -- public API -------------------------------------------------------------------------
    @property
    def every(self) -> int:
        """Optimizer steps between logged steps."""
        return self._every

    @property
    def module_names(self) -> tuple[str, ...]:
        """Names of the watched modules, in ``model.named_modules()`` order."""
        return self._module_names

    @property
    def global_step(self) -> int:
        """Index of the current optimizer step (the number of :meth:`step` calls so far)."""
        return self._step

    @property
    def recording(self) -> bool:
        """Whether the hooks record the current step (every ``every``-th; with ``spikes=`` those after a spike):
        ``torch.compiler.set_stance("force_eager" if hooks.recording else "default")`` runs it eagerly."""
        return self._state is _State.RECORDING

    @property
    def writer(self) -> SummaryWriter | None:
        """Where this process writes; ``None`` on a rank other than 0 given no ``writer=``."""
        return self._writer

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._state is _State.CLOSED

    @property
    def findings(self) -> list[Finding]:
        """Every finding that started so far, in order (empty with ``health=None``)."""
        health = self._diagnostics.health
        return [] if health is None else list(health.started)

    def summary(self) -> dict[str, float]:
        """Numbers for a progress bar (``tqdm.set_postfix(**hooks.summary())``) from the latest *written* step:
        ``grad_norm`` (global parameter-gradient norm), ``min_layer_grad`` (smallest output-gradient norm of a
        watched module), ``findings`` (how many hold now). On the CPU a logged step is written by its ``step()``;
        on CUDA once its copy to the host has completed, at a later ``step()`` or ``close()``."""
        return self._diagnostics.summary()

    def step(self, loss: Tensor | float | None = None) -> None:
        """Mark the end of one optimizer step; logs it if its index is a multiple of ``every``.

        Args:
            loss: for ``spikes=`` (which also logs the steps after a spike): the step's loss, not read here.

        Raises:
            HookLoggerError: after :meth:`close`.
        """
        if self._state is _State.CLOSED:
            raise HookLoggerError("step() called after close(); create a new HookLogger to log again")
        if self._state is _State.RECORDING and self._amp is None:
            # Not in close(): a step begun, not trained is no evidence; nor under a scaler (its skipped steps)
            self._recording.check_stepped(self._step)
        full = self._spikes.step(self._step, loss)  # whether the next step is logged in full
        if self._state.in_step:
            self._end_logged_step()
        self._step += 1
        self._write(wait=False)
        if self._step % self._every == 0 or full:
            self._begin_logged_step(full=full)

    def close(self) -> None:
        """Write everything pending, remove every hook, close the writer if the logger made it.
        Safe to call twice; afterwards the logger holds no reference to the model.

        The logged step begun by the last :meth:`step` is written only if it saw training work
        (a backward pass or an optimizer step), or if no earlier step recorded anything: forward
        passes after training (a ``predict()`` in training mode) are no step.

        Called while an exception propagates (a ``with`` block left by one, or ``close()`` in
        an ``except``/``finally``), it enters no collective: the other ranks may never reach
        theirs. A logged step that needs the other ranks is then dropped."""
        self._close(failing=sys.exc_info()[1] is not None)

    def __enter__(self) -> HookLogger:
        if self._state is _State.CLOSED:
            raise HookLoggerError("with-block entered on a closed HookLogger; create a new HookLogger to log again")
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close(failing=exc is not None)  # an exception handled around the block is not ours

    def __repr__(self) -> str:
        state = "closed" if self._state is _State.CLOSED else f"step={self._step}"
        return (
            f"HookLogger({len(self._module_names)} modules, {len(self._recording.params())} parameters, "
            f"every={self._every}, {state}, log_dir={self._writer.log_dir if self._writer else None!r})"
        )

    # -- the step state machine ---------------------------------------------------------------
    def _begin_logged_step(self, *, full: bool = False) -> None:
        """``full``: a step after a spike, which takes every histogram (as the first logged step does)."""
        if self._state is _State.OFF:
            if self._ranks.needed:  # a rank that stopped logging still joins while the others expect it
                self._state = _State.JOINING
            return
        self._state = _State.RECORDING
        self._recording.begin(0 if full else self._recorded_steps)
        if self._amp is not None:
            self._amp.begin()

    def _end_logged_step(self, *, written: bool = True) -> None:
        """``written``: write what the step recorded (else drop it; the ranks still meet)."""
        if (late := self._ranks.sharded_late(self._recording.parallel)) is not None:
            self._switch_off(f"logged step {self._step}", late)
        drained = packed = None
        try:
            self._recording.end()
            if self._amp is not None and not self._recording.empty:
                self._amp.finish(self._recording.buffer)
            drained = self._recording.drain(dropped=not written)
            if not self._ranks.packs_together(drained):
                packed = self._recording.pack(*drained[:2])
        except Exception as error:  # e.g. histc under deterministic CUDA
            self._switch_off(f"packing step {self._step}", error)
        self._recorded_steps += drained is not None and any(drained)
        if self._ranks.needed:
            # Every rank takes part, even one that recorded nothing or stopped logging; records that cannot be
            # combined, or a failed collective, stop every rank's logging (no abort, no hang; a warning each).
            mine = None if self._state.off else drained or ([], [], [])
            try:
                rec = self._recording
                packed = self._ranks.finish(mine, packed, rec.pack, rec.resolve, stages=rec.activations.passes.stages)
            except Exception as error:  # different calls on different ranks, a broken process group
                packed = None
                self._ranks.stop()
                self._switch_off(f"combining step {self._step} over ranks", error)
        if packed is not None and self._outbox is not None and not self._state.off:
            self._outbox.send(self._step, *packed)
        self._state = _State.OFF if self._state.off else _State.IDLE

    def _switch_off(self, what: str, error: BaseException) -> None:
        """Stop all logging after a failure outside the hooks, warning once; training continues."""
        self._recording.stop()
        if self._outbox is not None:
            self._outbox.drop()
        if self._state.off:
            return
        self._state = _State.JOINING if self._state.in_step else _State.OFF
        _warn_switched_off(what, error, self._writer)

    # -- writing and closing -------------------------------------------------------------------
    def _write(self, *, wait: bool) -> None:
        """Write finished transfers in step order; with ``wait``, all of them."""
        if self._outbox is None or self._state.off:
            return
        try:
            self._outbox.write(wait=wait)
        except WriteError as failure:
            self._switch_off(f"writing step {failure.step} to TensorBoard", failure.error)

    def _close(self, *, failing: bool) -> None:
        if self._state is _State.CLOSED:
            return
        try:
            if self._state.in_step and failing and self._ranks.needed:
                self._recording.stop()  # dropped, see close()
                self._state = _State.OFF if self._state.off else _State.IDLE
            elif self._state.in_step:
                # A prediction after the last step() is no training step, unless it is the run's only one.
                self._end_logged_step(written=self._recording.trained or not self._recorded_steps)
            self._write(wait=True)
            self._spikes.close()
            if self._destination is not None and not self._state.off:
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
            self._state = _State.CLOSED


def _model_to_watch(model: object) -> tuple[nn.Module, bool]:
    """The module to hook: a ``DistributedDataParallel`` or ``DataParallel`` wrapper's ``.module``
    (so tags name the user's modules); and whether its gradients are averaged over ranks, so
    final only when the optimizer steps."""
    if not isinstance(model, nn.Module):
        raise HookLoggerError(f"model must be an nn.Module, got {type(model).__name__}")
    wrapper = model if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)) else None
    inner = model if wrapper is None else wrapper.module
    if is_compiled(inner):
        within = "" if wrapper is None else f" inside {type(wrapper).__name__}"
        raise HookLoggerError(
            f"model is already compiled ({type(inner).__name__}{within}); hooks added now would be ignored by the "
            "compiled code (and by code it compiled earlier): create the HookLogger first, on the plain model, then "
            "compile it, then wrap it (hooks = HookLogger(model, optimizer=opt); model = torch.compile(model); "
            "model = DDP(model))"
        )
    averaged = isinstance(wrapper, nn.parallel.DistributedDataParallel) or rank_and_world()[1] > 1
    return inner, averaged


def _check_optimizer(config: Options, *, averaged: bool, split: bool, graded: bool) -> None:
    """``optimizer=`` is required where the parameter gradients (``graded``: some are read, those
    of the global norm too) are final only when the optimizer steps: averaged over ranks (DDP), or split over them
    (FSDP2, tensor parallelism)."""
    if config.optimizer is None and graded and (split or averaged):
        what = "a sharded model" if split else f"a model trained over {rank_and_world()[1]} ranks (DDP)"
        raise HookLoggerError(
            f"optimizer= is required for {what}, whose parameter gradients are final only when the optimizer steps "
            "(DDP averages them during backward): pass optimizer=your_optimizer, or parameters=False"
        )


def _outbox(
    destination: Destination | None, diagnostics: Diagnostics, recording: Recording, divisor: Callable[[], float]
) -> Outbox | None:
    """Where logged steps go once copied to the host: diagnosed and written to ``destination``
    (``divisor``: of the output gradients, ``distributed.gradient_divisor``; times a pipeline
    schedule's, ``PassFilter.microbatches``)."""
    if destination is None:
        return None
    scaled = recording.optimizer_hooks is None  # (see scaling.unscale)
    write = functools.partial(diagnostics.write, destination)
    passes = recording.activations.passes
    return Outbox(
        write,
        param_grads_scaled=scaled,
        numerics=recording.numerics,
        gradient_divisor=lambda: divisor() * passes.microbatches,
    )


def _open_writer(config: Options, rank: int) -> tuple[SummaryWriter | None, bool]:
    """Where this rank writes, and whether the logger made (and so closes) that writer."""
    if config.writer is not None or rank != 0:
        return config.writer, False
    return _make_writer(config.log_dir, purge_step=config.start_step or None), True


def _select(model: nn.Module, config: Options) -> tuple[dict[str, nn.Module], dict[str, nn.Module], frozenset[str]]:
    """The watched modules, those of them whose feature maps are taken, and those whose logits are measured."""
    selected = select_modules(model, config.modules)
    maps = config.feature_maps
    mapped = {} if is_off(maps) else select_modules(model, maps, "feature_maps")
    if set(mapped) - set(selected):
        raise HookLoggerError(
            f"feature_maps= selects modules that are not watched: {sorted(set(mapped) - set(selected))!r}; "
            "add them to modules= as well"
        )
    return selected, mapped, _logit_modules(model, config, selected)


def _logit_modules(model: nn.Module, config: Options, selected: dict[str, nn.Module]) -> frozenset[str]:
    """The watched modules whose output logits ``logits=`` asks for (``True``: the last watched one)."""
    chosen = config.logits
    if is_off(chosen):
        return frozenset()
    if isinstance(chosen, bool):  # (True)
        return frozenset(list(selected)[-1:])
    named = select_modules(model, chosen, "logits")
    if set(named) - set(selected):
        raise HookLoggerError(
            f"logits= selects modules that are not watched: {sorted(set(named) - set(selected))!r}; "
            "add them to modules= as well"
        )
    return frozenset(named)


def _warn_switched_off(what: str, error: BaseException, writer: SummaryWriter | None) -> None:
    warnings.warn(
        f"tblog_hooks: {what} failed, so logging is switched off (training continues; "
        f"log_dir={writer.log_dir if writer else None!r}): {type(error).__name__}: {error}",
        RuntimeWarning,
        stacklevel=5,
    )


def _tensor_parallel(model: nn.Module, selected: dict[str, nn.Module]) -> TensorParallel:
    """How ``model`` is split over tensor-parallel ranks, looked up; the compiled parts among
    ``selected`` checked against it."""
    parallel = TensorParallel(model)
    parallel.look_up()
    _check_compiled_parts(model, selected)
    return parallel


def _check_compiled_parts(model: nn.Module, selected: dict[str, nn.Module]) -> None:
    """Refuse watched modules inside a compiled submodule (``torch.compile`` per block) whose
    compiled code already ran: it ignores hooks added since, so their tags would be missing."""
    for name, _, part in named_modules(model):
        if part is model or not is_compiled(part) or not compiled_code_ran(part):
            continue
        inside = {id(m) for m in part.modules()}
        watched = [n for n, m in selected.items() if id(m) in inside]
        if watched:
            listed = ", ".join(map(repr, watched[:3])) + (", ..." if len(watched) > 3 else "")
            raise HookLoggerError(
                f"{name!r} is compiled ({type(part).__name__}) and its compiled code already ran, so hooks added now "
                f"to the watched modules inside it ({listed}) would be ignored by that code: create the HookLogger "
                "before the first forward of the compiled modules (compiling them before is fine), or leave them "
                "out of modules="
            )


def _detach(
    recording: Recording, destination: Destination | None, owns_writer: bool, restore: Callable[[], None] | None
) -> None:
    """Remove every hook, stop recording, close an owned writer, give the writer its checksum
    back: the end of ``close()``, and what a logger garbage-collected without ``close()`` gets
    (``weakref.finalize``; holds no logger)."""
    recording.release()
    if destination is None:
        return
    destination.close()
    try:
        if owns_writer:
            destination.writer.close()
    finally:
        if restore is not None:
            restore()


def _warn_if_shared(model: nn.Module, destination: Destination | None) -> None:
    """Warn once if another live logger writes the same tags here, or else watches this model."""
    if destination is not None and destination.open():
        where = f"{destination.directory!r}" + (f" with prefix={destination.prefix!r}" if destination.prefix else "")
        warnings.warn(
            f"tblog_hooks: another live HookLogger already writes into {where}: both write the same tags "
            "(activation/mean/0, ...) into one series. Give each logger its own prefix= (e.g. prefix='G' and "
            "prefix='D'), or close() the other logger first (re-ran a notebook cell? close the old logger)",
            UserWarning,
            stacklevel=3,
        )
    elif any(ours(hook) for m in model.modules() for hook in forward_hooks(m)):
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
        where = "SummaryWriter()'s default directory (no log_dir= given)" if log_dir is None else f"log_dir={log_dir!r}"
        raise HookLoggerError(
            f"{where} must be a directory this process can create files in: "
            f"{type(error).__name__}: {error}; pass a writable path, or writer=SummaryWriter(...)"
        ) from None
