"""The options of :class:`~tblog_hooks.HookLogger`, validated once: the fields of :class:`Options`
are the option list. They are also the constructors' signatures (:func:`logger_signature`,
:func:`callback_signature`: what ``help()``, editors and mypy see) and the options page
(``tests/test_docs.py`` holds ``docs/options.md`` to them); the framework callbacks take the
fields of :class:`WatchOptions`.

"Off" is spelled ``False`` or ``None`` alike for every option that switches a watch off
(``histograms``, ``feature_maps``, ``attention``, ``health``, ``spikes``, ``numerics``, ``logits``):
:func:`~tblog_hooks.keywords.is_off` reads it.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Concatenate, Literal, NoReturn, ParamSpec, TypeVar

import torch
from torch.utils.tensorboard import SummaryWriter

from ._compat import writer_closed
from .diagnostics.findings import Thresholds
from .diagnostics.spikes import Spikes, spikes_option
from .errors import HookLoggerError
from .keywords import switched, unknown_keywords
from .stats import numerics
from .stats.kinds import Measure
from .stats.recipe import Recipe
from .stats.schedule import Histograms, schedule
from .stats.tags import Root

if TYPE_CHECKING:
    from .capture.selection import Selector

#: The options that are True or False, and nothing else (``"no"`` is not off).
_SWITCHES = ("activations", "gradients", "parameters", "eval_passes", "reduce_ranks", "inputs")


#: The options that take selectors of watched modules, and what else each takes (an empty list
#: of selectors would select nothing: refused).
_SELECTING = {
    "feature_maps": "None or False (none)",
    "attention": "True, False or None (off)",
    "logits": "True (the last watched module), False or None (off)",
}


@dataclass(frozen=True, kw_only=True)
class WatchOptions:
    """The options that say what is watched and how: every option but those a training loop's
    framework supplies (:class:`Options` adds them); the framework callbacks take these."""

    #: One selector or a list (:data:`~tblog_hooks.Selector`); default: every module that owns
    #: parameters itself, with children or not.
    modules: Selector | Sequence[Selector] | None = None
    #: Log optimizer steps ``0, every, 2*every, ...`` (counted in ``step()`` calls).
    every: int = 100
    #: Log ``activation/*`` (outputs) of the watched modules.
    activations: bool = True
    #: Log ``gradient/*`` (gradients w.r.t. the outputs).
    gradients: bool = True
    #: Log ``param_grad/*`` (and with ``optimizer=`` ``param/update_ratio/*``).
    parameters: bool = True
    #: Which histograms logged steps write: ``True`` (``Histograms()``), ``False`` or ``None``
    #: (none), an int ``n`` (on every ``n``-th logged step) or a :class:`~tblog_hooks.Histograms`
    #: (as one: :attr:`histogram_schedule`).
    histograms: bool | int | Histograms | None = True
    #: Also record forward passes in eval mode or under ``torch.no_grad()``.
    eval_passes: bool = False
    #: Under ``torch.distributed``, pool activation, input and output-gradient statistics over all
    #: ranks; under a pipeline schedule, write every stage's modules from the writing rank.
    reduce_ranks: bool = False
    #: Also log ``input/{stat}/{module}``, the statistics of each watched module's inputs.
    inputs: bool = False
    #: Selectors (as for ``modules``) of watched modules whose output is shown as an image;
    #: ``None`` or ``False``: none.
    feature_maps: Selector | Sequence[Selector] | Literal[False] | None = None
    #: Log ``attention/*`` of the ``scaled_dot_product_attention`` calls of logged forward passes
    #: (``docs/attention.md``): ``True`` (every module), ``False`` or ``None`` (off), or selectors
    #: (as for ``modules``) of the modules whose calls (their own and their submodules') are covered.
    attention: bool | Selector | Sequence[Selector] | None = False
    #: When health findings start: a :class:`~tblog_hooks.Thresholds` (``True``: the defaults),
    #: or ``False`` or ``None`` to switch them off (as one: :attr:`thresholds`).
    health: Thresholds | bool | None = field(default_factory=Thresholds)
    #: Put every tag under ``{prefix}/`` (several models in one directory).
    prefix: str | None = None
    #: Watch every step's gradient norm and loss for spikes (``docs/spikes.md``): ``True``
    #: (``Spikes()``), ``False`` or ``None`` (off) or a :class:`~tblog_hooks.Spikes` (as one:
    #: :attr:`spike_config`).
    spikes: bool | Spikes | None = False
    #: Log the low-precision health of the watched tensors (``docs/numerics.md``): max |x|, RMS,
    #: kurtosis and per format the fractions lost to underflow and overflow. ``True`` writes them
    #: for the format the run trains in (the autocast dtype, else ``"bf16"``), a tuple of names
    #: among ``"fp16"``, ``"bf16"``, ``"e4m3"``, ``"e5m2"`` for those; every format is in the
    #: ``health/numerics_*`` pictures. ``False`` or ``None``: off.
    numerics: bool | Sequence[str] | None = False
    #: Statistics of one's own (:class:`~tblog_hooks.stats.kinds.Measure`), by the source they
    #: measure: ``"output"``, ``"input"`` (with ``inputs=True``) or ``"output_gradient"``
    #: (``docs/architecture.md``, "Adding a statistic"). This logger's only.
    measures: Mapping[str, Sequence[Measure]] | None = None
    #: Log ``activation/log_z/{module}`` (and ``log_z_max``, ``z_loss``), the log-partition
    #: ``log Σ exp(z)`` over the last dim of the output logits of the modules that produce them
    #: (``docs/numerics.md``): ``True`` (the last watched module, in ``module_names`` order),
    #: selectors (as for ``modules``) of watched modules, or ``False`` or ``None`` (off).
    logits: bool | Selector | Sequence[Selector] | None = False
    #: With e4m3 or e5m2 in ``numerics``, how the fp8 recipe scales each Linear's input and
    #: weight before their e4m3 cast: ``"tensorwise"`` (one scale per tensor) or ``"rowwise"``
    #: (one per row, torchao's ``Float8LinearConfig.from_recipe_name("rowwise")``).
    fp8_scaling: Literal["tensorwise", "rowwise"] = "tensorwise"

    def __post_init__(self) -> None:
        for name in _SWITCHES:
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise HookLoggerError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise HookLoggerError(f"every must be a positive int (log every N optimizer steps), got {self.every!r}")
        if not (self.activations or self.gradients or self.parameters):
            raise HookLoggerError(
                "activations, gradients and parameters are all False, so nothing would be logged; "
                "leave at least one of them True"
            )
        prefix = self.prefix
        if prefix is not None and (not isinstance(prefix, str) or not prefix.strip("/") or prefix.strip("/") != prefix):
            raise HookLoggerError(
                f"prefix must be a non-empty str without a leading or trailing '/' (tags become "
                f"'{{prefix}}/activation/...'; e.g. prefix='generator'), or None, got {prefix!r}"
            )
        for name, besides in _SELECTING.items():
            value = getattr(self, name)
            if isinstance(value, (list, tuple)) and not value:
                raise HookLoggerError(
                    f"{name} must be {besides}, or one or more selectors (as for modules=) of watched modules, "
                    f"got {value!r}"
                )
        self._check_fp8_scaling()
        _ = self.thresholds, self.spike_config, self.numerics_formats, self.recipe  # (checked)
        self._check_histogram_kinds()

    @functools.cached_property
    def thresholds(self) -> Thresholds | None:
        """``health=`` as a :class:`~tblog_hooks.Thresholds`; ``None``: no findings."""
        return switched(self.health, Thresholds, _not_thresholds)

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
        return Recipe.build(
            inputs=self.inputs,
            numerics=self.numerics_formats is not None,
            measures=self.measures,
            rowwise=self.fp8_scaling == "rowwise",
        )

    def _check_fp8_scaling(self) -> None:
        """``fp8_scaling`` is a recipe's name, and other than the default only with a float8 format named."""
        if self.fp8_scaling not in numerics.SCALINGS:
            raise HookLoggerError(
                f"fp8_scaling must be one of {', '.join(map(repr, numerics.SCALINGS))} (torchao's float8 recipes), "
                f"got {self.fp8_scaling!r}"
            )
        formats = self.numerics_formats or ()
        if self.fp8_scaling != "tensorwise" and not any(numerics.FORMATS[f].scaled for f in formats):
            raise HookLoggerError(
                f"fp8_scaling={self.fp8_scaling!r} says how fp8 training scales its casts, which are counted only "
                "with e4m3 or e5m2 in numerics=: pass numerics=('e4m3',) (or with the format the run trains in), "
                "or leave fp8_scaling out"
            )

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


@dataclass(frozen=True, kw_only=True)
class Options(WatchOptions):
    """Every option of ``HookLogger(model, **options)``: :class:`WatchOptions` and where the logger
    writes, the loop's optimizer and scaler and its first step. Bad values raise
    :class:`HookLoggerError` at construction, saying what was wrong, the value and what is valid."""

    #: Directory for a ``SummaryWriter`` the logger creates and closes. With neither ``log_dir``
    #: nor ``writer``, ``SummaryWriter()``'s default ``runs/<date>_<host>``.
    log_dir: str | os.PathLike[str] | None = None
    #: Your own open ``torch.utils.tensorboard.SummaryWriter`` (or a subclass): flushed, never
    #: closed. Not together with ``log_dir``. Close the logger before the writer.
    writer: SummaryWriter | None = None
    #: The loop's optimizer, or a list or tuple of them: gradients are then read when an
    #: optimizer steps them. Required for DDP, FSDP2 and tensor-parallel models unless ``parameters=False``.
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None
    #: The loop's ``torch.amp.GradScaler``: gradients are unscaled and skipped steps reported.
    scaler: torch.amp.GradScaler | None = None
    #: The index of the first ``step()`` call, e.g. the optimizer steps a resumed run already made.
    start_step: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.writer is not None and self.log_dir is not None:
            raise HookLoggerError("pass either log_dir (the logger makes and closes a writer) or writer, not both")
        start = self.start_step
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise HookLoggerError(
                f"start_step must be an int >= 0 (the index of the first step() call, e.g. the optimizer "
                f"steps a resumed run already made), got {start!r}"
            )
        if self.writer is not None:
            _check_writer(self.writer)
        _check_optimizers(self.optimizer)
        if self.scaler is not None and not isinstance(self.scaler, torch.amp.GradScaler):
            raise HookLoggerError(f"scaler must be a torch.amp.GradScaler, got {type(self.scaler).__name__}")


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


def check_names(options: Mapping[str, object], names: Sequence[str] = NAMES, owner: str = "HookLogger") -> None:
    """Keywords that are no option (of ``names``) are an error naming the closest option of each."""
    unknown = [key for key in options if key not in names]
    if unknown:
        raise HookLoggerError(unknown_keywords(owner, unknown, names, "option"))


P = ParamSpec("P")
S = TypeVar("S")
M = TypeVar("M")
Init = TypeVar("Init", bound=Callable[..., None])


def logger_signature(
    source: Callable[P, object],
) -> Callable[[Callable[Concatenate[S, M, ...], None]], Callable[Concatenate[S, M, P], None]]:
    """Decorator of ``HookLogger.__init__(self, model, **options)``: its options are the fields of
    ``source`` (:class:`Options`) as keyword-only parameters, for mypy and editors (the type) and for
    ``help()`` and :func:`inspect.signature` (the signature made from the fields)."""
    return functools.partial(_signed, source, {})


def callback_signature(
    source: Callable[P, object], **shown: str
) -> Callable[[Callable[Concatenate[S, ...], None]], Callable[Concatenate[S, P], None]]:
    """As :func:`logger_signature`, for a framework callback's ``__init__(self, **options)``
    (``source``: :class:`WatchOptions`); ``shown``: defaults the framework supplies, by what
    supplies them (``every="trainer.log_every_n_steps"``)."""
    return functools.partial(_signed, source, shown)


def _default(option: Field[Any], shown: Mapping[str, str]) -> object:
    """An option's default as a signature shows it."""
    if option.name in shown:
        return _Shown(shown[option.name])
    if option.default is MISSING:  # made by a factory (health's Thresholds())
        return _Shown(f"{getattr(option.default_factory, '__name__', '')}()")
    return option.default


class _Shown:
    """A default shown in a signature as text: what supplies it, or the call that makes it."""

    def __init__(self, text: str) -> None:
        self._text = text

    def __repr__(self) -> str:
        return self._text


def _signed(source: Any, shown: Mapping[str, str], init: Init) -> Init:
    """``init`` with ``__signature__``: its positional parameters, then ``source``'s fields as they
    are written (annotations as in the source; a default made by a factory as its call)."""
    own = [p for p in inspect.signature(init).parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_default(f, shown), annotation=f.type)
        for f in fields(source)
    ]
    init.__signature__ = inspect.Signature([*own, *options], return_annotation=None)  # type: ignore[attr-defined]
    return init


def _not_thresholds(health: object) -> NoReturn:
    raise HookLoggerError(
        f"health must be a tblog_hooks.Thresholds (True: the defaults), or False or None to switch findings "
        f"off, got {health!r}"
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
