"""The options of :class:`~tblog_hooks.HookLogger`, validated once: the fields of :class:`Options`
are the option list (the framework callbacks read it from there too)."""

from __future__ import annotations

import difflib
import functools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

import torch
from torch.utils.tensorboard import SummaryWriter

from ._compat import writer_closed
from .diagnostics.findings import Thresholds
from .diagnostics.spikes import Spikes, spikes_option
from .errors import HookLoggerError
from .stats import numerics
from .stats.kinds import Measure
from .stats.recipe import Recipe
from .stats.schedule import Histograms, schedule
from .stats.tags import Root

if TYPE_CHECKING:
    from .capture.selection import Selector


@dataclass(frozen=True, kw_only=True)
class Options:
    """Every option of ``HookLogger(model, **options)``; bad values raise :class:`HookLoggerError`
    at construction, saying what was wrong, the value and what is valid."""

    #: Directory for a ``SummaryWriter`` the logger creates and closes. With neither ``log_dir``
    #: nor ``writer``, ``SummaryWriter()``'s default ``runs/<date>_<host>``.
    log_dir: str | os.PathLike[str] | None = None
    #: Your own open ``torch.utils.tensorboard.SummaryWriter`` (or a subclass): flushed, never
    #: closed. Not together with ``log_dir``. Close the logger before the writer.
    writer: SummaryWriter | None = None
    #: One selector or a list (:data:`~tblog_hooks.Selector`); default: every leaf module that
    #: owns parameters.
    modules: Selector | Sequence[Selector] | None = None
    #: Log optimizer steps ``0, every, 2*every, ...`` (counted in ``step()`` calls).
    every: int = 100
    #: Log ``activation/*`` (outputs) of the watched modules.
    activations: bool = True
    #: Log ``gradient/*`` (gradients w.r.t. the outputs).
    gradients: bool = True
    #: Log ``param_grad/*`` (and with ``optimizer=`` ``param/update_ratio/*``).
    parameters: bool = True
    #: Which histograms logged steps write: ``True`` (``Histograms()``), ``False`` (none), an int
    #: ``n`` (on every ``n``-th logged step) or a :class:`~tblog_hooks.Histograms`
    #: (as one: :attr:`histogram_schedule`).
    histograms: bool | int | Histograms | None = True
    #: The loop's optimizer, or a list or tuple of them: gradients are then read when an
    #: optimizer steps them. Required for DDP, FSDP2 and tensor-parallel models unless ``parameters=False``.
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None
    #: The loop's ``torch.amp.GradScaler``: gradients are unscaled and skipped steps reported.
    scaler: torch.amp.GradScaler | None = None
    #: Also record forward passes in eval mode or under ``torch.no_grad()``.
    eval_passes: bool = False
    #: Under ``torch.distributed``, pool activation, input and output-gradient statistics over all ranks.
    reduce_ranks: bool = False
    #: Also log ``input/{stat}/{module}``, the statistics of each watched module's inputs.
    inputs: bool = False
    #: Selectors (as for ``modules``) of watched modules whose output is shown as an image.
    feature_maps: Selector | Sequence[Selector] | None = None
    #: Log ``attention/*`` of the ``scaled_dot_product_attention`` calls of logged forward passes
    #: (``docs/attention.md``): ``True`` (every module), ``False``, or selectors (as for ``modules``)
    #: of the modules whose calls (their own and their submodules') are covered.
    attention: bool | Selector | Sequence[Selector] = False
    #: When health findings start, or ``None`` to switch them off.
    health: Thresholds | None = field(default_factory=Thresholds)
    #: The index of the first ``step()`` call, e.g. the optimizer steps a resumed run already made.
    start_step: int = 0
    #: Put every tag under ``{prefix}/`` (several models in one directory).
    prefix: str | None = None
    #: Watch every step's gradient norm and loss for spikes (``docs/spikes.md``): ``True``
    #: (``Spikes()``), ``False`` or a :class:`~tblog_hooks.Spikes` (as one: :attr:`spike_config`).
    spikes: bool | Spikes | None = False
    #: Log the low-precision health of the watched tensors (``docs/numerics.md``): max |x|, RMS,
    #: kurtosis and per format the fractions lost to underflow and overflow. ``True`` writes them
    #: for the format the run trains in (the autocast dtype, else ``"bf16"``), a tuple of names
    #: among ``"fp16"``, ``"bf16"``, ``"e4m3"``, ``"e5m2"`` for those; every format is in the
    #: ``health/numerics_*`` pictures. ``False``: off.
    numerics: bool | Sequence[str] = False
    #: Statistics of one's own (:class:`~tblog_hooks.stats.kinds.Measure`), by the source they
    #: measure: ``"output"``, ``"input"`` (with ``inputs=True``) or ``"output_gradient"``
    #: (``docs/architecture.md``, "Adding a statistic"). This logger's only.
    measures: Mapping[str, Sequence[Measure]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise HookLoggerError(f"every must be a positive int (log every N optimizer steps), got {self.every!r}")
        if self.writer is not None and self.log_dir is not None:
            raise HookLoggerError("pass either log_dir (the logger makes and closes a writer) or writer, not both")
        if not (self.activations or self.gradients or self.parameters):
            raise HookLoggerError(
                "activations, gradients and parameters are all False, so nothing would be logged; "
                "leave at least one of them True"
            )
        start = self.start_step
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise HookLoggerError(
                f"start_step must be an int >= 0 (the index of the first step() call, e.g. the optimizer "
                f"steps a resumed run already made), got {start!r}"
            )
        prefix = self.prefix
        if prefix is not None and (not isinstance(prefix, str) or not prefix.strip("/") or prefix.strip("/") != prefix):
            raise HookLoggerError(
                f"prefix must be a non-empty str without a leading or trailing '/' (tags become "
                f"'{{prefix}}/activation/...'; e.g. prefix='generator'), or None, got {prefix!r}"
            )
        if self.writer is not None:
            _check_writer(self.writer)
        _check_optimizers(self.optimizer)
        if self.attention is None or (isinstance(self.attention, (list, tuple)) and not self.attention):
            raise HookLoggerError(
                f"attention must be True, False, or one or more selectors (as for modules=), got {self.attention!r}"
            )
        if self.scaler is not None and not isinstance(self.scaler, torch.amp.GradScaler):
            raise HookLoggerError(f"scaler must be a torch.amp.GradScaler, got {type(self.scaler).__name__}")
        if self.health is not None and not isinstance(self.health, Thresholds):
            raise HookLoggerError(
                f"health must be a tblog_hooks.Thresholds (or None to switch findings off), got {self.health!r}"
            )
        _ = self.spike_config  # (checked)
        _ = self.numerics_formats  # (checked)
        _ = self.recipe  # (checked)
        self._check_histogram_kinds()

    @functools.cached_property
    def histogram_schedule(self) -> Histograms | None:
        """``histograms=`` as a :class:`~tblog_hooks.Histograms`; ``None``: no histograms."""
        return schedule(self.histograms)

    @functools.cached_property
    def spike_config(self) -> Spikes | None:
        """``spikes=`` as a :class:`~tblog_hooks.Spikes`; ``None``: off."""
        return spikes_option(self.spikes)

    @functools.cached_property
    def numerics_formats(self) -> tuple[str, ...] | None:
        """``numerics=`` as the formats it names (``()``: the run's own), ``None``: off."""
        try:
            return numerics.check(self.numerics)
        except ValueError as error:
            raise HookLoggerError(str(error)) from None

    @functools.cached_property
    def recipe(self) -> Recipe:
        """What the logger records (``stats/recipe.py``), built from these options."""
        return Recipe.build(inputs=self.inputs, numerics=self.numerics_formats is not None, measures=self.measures)

    def _check_histogram_kinds(self) -> None:
        """Histogram kinds asked for by name must be ones the other options produce."""
        histograms = self.histogram_schedule
        if histograms is None or not histograms.explicit:
            return
        missing = {kind: option for kind in histograms.kinds if not getattr(self, option := _PRODUCED_BY[kind])}
        if missing:
            kinds = ", ".join(map(repr, missing))
            options = ", ".join(f"{option}=True" for option in dict.fromkeys(missing.values()))
            raise HookLoggerError(
                f"Histograms(kinds=...) asks for {kinds} histograms, which need {options}: pass {options} as well, "
                "or leave those kinds out"
            )


#: The option that makes the logger record each histogram kind.
_PRODUCED_BY: dict[str, str] = {
    Root.ACTIVATION: "activations",
    Root.INPUT: "inputs",
    Root.GRADIENT: "gradients",
    Root.GRADIENT_LOG10: "gradients",
    Root.PARAM_GRAD: "parameters",
    Root.PARAM: "parameters",
}
#: Every option's name, in declaration order.
NAMES: tuple[str, ...] = tuple(f.name for f in fields(Options))


def check_names(options: Mapping[str, object]) -> None:
    """Keywords that are no option are an error naming the closest option of each."""
    unknown = [key for key in options if key not in NAMES]
    if unknown:
        raise HookLoggerError(unknown_options(unknown))


def unknown_options(unknown: Sequence[str]) -> str:
    """The message for keywords that are no option, each with the closest option name."""
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, NAMES, n=1)
        parts.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return f"HookLogger got unknown option(s) {', '.join(parts)}; valid options: {', '.join(NAMES)}"


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


def _check_writer(writer: object) -> None:
    if not isinstance(writer, SummaryWriter):
        kind = type(writer)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        raise HookLoggerError(
            f"writer must be a torch.utils.tensorboard.SummaryWriter (or a subclass), got {name}; for another "
            "library's writer (tensorboardX, ...), pass log_dir= with its directory: the logger makes its own writer"
        )
    if writer_closed(writer):
        raise HookLoggerError(
            f"writer= was closed (SummaryWriter.close(), log_dir={writer.get_logdir()!r}); writing to it would open "
            "a new event file: pass an open SummaryWriter, or log_dir="
        )
