"""Findings and their thresholds: what every rule produces and is configured by, and the
trailing median the rules that compare a value with its own history share.

A leaf of the package (no torch): the live logger, ``tblog-hooks report`` and the dashboard read
findings through it.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import statistics
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import NamedTuple

from ..errors import HookLoggerError
from ..keywords import keywords


class FindingKind(enum.StrEnum):
    """What a :class:`Finding` is about (its ``kind``)."""

    VANISHING_GRADIENT = "vanishing_gradient"
    EXPLODING_GRADIENT = "exploding_gradient"
    DEAD_UNITS = "dead_units"
    NONFINITE = "nonfinite"
    AMP_SKIPPED_STEPS = "amp_skipped_steps"
    ATTENTION_LOGIT_GROWTH = "attention_logit_growth"
    ATTENTION_ENTROPY_COLLAPSE = "attention_entropy_collapse"
    #: With ``numerics=``: ``diagnostics/numerics_rules.py``.
    FP16_GRADIENT_UNDERFLOW = "fp16_gradient_underflow"
    FP8_UNDERFLOW = "fp8_underflow"
    FP8_OVERFLOW = "fp8_overflow"
    MASSIVE_ACTIVATION = "massive_activation"
    #: With ``logits=``: ``diagnostics/logit_rules.py``.
    LOGIT_DRIFT = "logit_drift"
    #: With ``spikes=``: judged every step by ``diagnostics/spikes.py``; each starts and ends at its own step.
    GRADIENT_SPIKE = "gradient_spike"
    LOSS_SPIKE = "loss_spike"


class Measure(NamedTuple):
    """What a kind's :attr:`Finding.value` is: ``label``, a few words beside the number (the
    dashboard's findings table), and ``meaning``, the sentence that says it exactly."""

    label: str
    meaning: str


#: What each kind's ``value`` is (the quantity its rule compared): one entry per kind, here only.
MEASURES: dict[FindingKind, Measure] = {
    FindingKind.VANISHING_GRADIENT: Measure(
        "ratio to the largest norm",
        "the largest output-gradient norm from the input up to the module, divided by the largest in the model "
        "at that step (a ratio, not the module's own norm, which its cell shows)",
    ),
    FindingKind.EXPLODING_GRADIENT: Measure(
        "update ratio, else norm",
        "the median update-to-weight ratio of the watched parameters where the optimizer step moved them too far, "
        "else the largest output-gradient norm (the message says which)",
    ),
    FindingKind.DEAD_UNITS: Measure(
        "fraction of units", "the fraction of the module's units never positive across the batch"
    ),
    FindingKind.NONFINITE: Measure(
        "NaN/Inf count, or norm",
        "how many NaN/Inf the module's output or output gradient held; for a parameter's gradient, or the "
        "step's gradient norm with spikes=, that non-finite norm",
    ),
    FindingKind.AMP_SKIPPED_STEPS: Measure(
        "logged steps skipped", "how many logged steps in a row the GradScaler skipped"
    ),
    FindingKind.ATTENTION_LOGIT_GROWTH: Measure("max logit", "the module's largest attention logit (signed)"),
    FindingKind.ATTENTION_ENTROPY_COLLAPSE: Measure(
        "entropy (nats)",
        "the module's mean attention entropy in nats (its lowest head's where per-head values were written)",
    ),
    FindingKind.FP16_GRADIENT_UNDERFLOW: Measure(
        "fraction lost", "the fraction of the module's output gradient lost to zero in fp16 at the step's loss scale"
    ),
    FindingKind.FP8_UNDERFLOW: Measure(
        "fraction lost",
        "the largest fraction of what fp8 training casts in the Linear (input, weight, output gradient) lost to "
        "zero after scaling (per tensor; with fp8_scaling='rowwise' per row, the output gradient per row and "
        "per column)",
    ),
    FindingKind.FP8_OVERFLOW: Measure(
        "fraction NaN/Inf",
        "the largest fraction of what fp8 training casts in the Linear that becomes NaN/Inf after scaling",
    ),
    FindingKind.MASSIVE_ACTIVATION: Measure("max |output|", "the module's largest |output|"),
    FindingKind.LOGIT_DRIFT: Measure(
        "mean log Z (nats)", "the mean over tokens of the log-partition log Σexp(z) of the module's output logits"
    ),
    FindingKind.GRADIENT_SPIKE: Measure(
        "ratio to recent median",
        "the gradient norm (global, or the module's own) divided by its median of recent steps",
    ),
    FindingKind.LOSS_SPIKE: Measure("ratio to recent median", "the loss divided by its median of recent steps"),
}

#: Every finding kind, in the order tables list them.
FINDING_KINDS: tuple[str, ...] = tuple(kind.value for kind in FindingKind)
VANISHING, EXPLODING, DEAD, NONFINITE, SKIPPING = FINDING_KINDS[:5]
LOGIT_GROWTH, ENTROPY_COLLAPSE = FindingKind.ATTENTION_LOGIT_GROWTH.value, FindingKind.ATTENTION_ENTROPY_COLLAPSE.value
FP16_UNDERFLOW, FP8_UNDERFLOW = FindingKind.FP16_GRADIENT_UNDERFLOW.value, FindingKind.FP8_UNDERFLOW.value
FP8_OVERFLOW, MASSIVE = FindingKind.FP8_OVERFLOW.value, FindingKind.MASSIVE_ACTIVATION.value
LOGIT_DRIFT = FindingKind.LOGIT_DRIFT.value
_SMALLER_IS_WORSE = (VANISHING, ENTROPY_COLLAPSE)  # finding kinds whose smaller values are worse
#: Modules named per kind in the log line (the worst ones) and rows per kind in the text summary.
LOG_WORST, TABLE_ROWS = 3, 20
#: Findings are reported here, one line per logged step that starts any (WARNING level).
log = logging.getLogger("tblog_hooks.health")


@keywords(
    fp16_underflow=FindingKind.FP16_GRADIENT_UNDERFLOW.value,
    massive_value=FindingKind.MASSIVE_ACTIVATION.value,
    skipped_steps=FindingKind.AMP_SKIPPED_STEPS.value,
)
@dataclass(frozen=True)
class Thresholds:
    """When a finding starts. A rule is switched off by a value that is never crossed:
    ``vanishing_ratio=0``, ``math.inf`` for the others (``zero_steps`` is no rule of its own).

    Each field below is a keyword with a default; values are Python or NumPy numbers (not
    bools), and counts (of logged steps, not optimizer steps) are whole numbers. A field is named
    as the finding kind it tunes (``amp_skipped_steps``, ``fp16_gradient_underflow``,
    ``massive_activation``, ...) or starts with the kind's first word (``vanishing_ratio``,
    ``dead_fraction``, ``attention_entropy``); ``growth_window`` and ``zero_steps`` serve several
    rules. The old names ``fp16_underflow``, ``massive_value`` and ``skipped_steps`` still work
    for this release, with a ``DeprecationWarning``.

    Raises:
        HookLoggerError: a field that is not such a number or is out of its range, or an unknown
            keyword; the message names the field, the value and what is valid.
    """

    #: ``vanishing_gradient``: every output-gradient norm from the input up to a module (in
    #: forward order) is below this fraction of the largest one in the model at the same step.
    vanishing_ratio: float = 1e-4
    #: ``exploding_gradient``: with ``optimizer=``, the median update-to-weight ratio of the
    #: watched parameters is above this (the step moved the weights by many times their size) ...
    exploding_update: float = 10.0
    #: ... or the largest output-gradient norm is above this multiple of the median of the
    #: largest norms of the latest ``growth_window`` logged steps without this finding ...
    exploding_growth: float = 100.0
    #: ... or above this absolute value (off by default: norms scale with the loss reduction,
    #: batch and layer sizes, so no one number suits every model).
    exploding_norm: float = math.inf
    #: Earlier logged steps (not optimizer steps: the latest ones without the finding) the growth rules of
    #: ``exploding_gradient`` and ``attention_logit_growth`` compare with: a bounded window keeps
    #: the cost of a step constant.
    growth_window: int = 64
    #: ``dead_units``: this fraction of a module's units (the channels of a convolution or a batch,
    #: instance or group norm, else the last dim of its output) is never positive across the batch
    #: (the last module that ran, in forward order, is skipped: usually the output layer).
    dead_fraction: float = 0.9
    #: Evidence that is exactly zero (a zero output, all gradients up to a module exactly zero) is
    #: what zero-initialised layers show before their first update: it must last this many logged steps.
    zero_steps: int = 3
    #: ``amp_skipped_steps``: the ``GradScaler`` skipped this many logged steps in a row.
    amp_skipped_steps: float = 20
    #: ``attention_logit_growth``: with ``attention=``, if you set it, the magnitude of a module's
    #: max attention logit is above this (off by default: qk-layernorm runs that learn let their
    #: logits creep to 30-40, some pretrained LLMs run with more) ...
    attention_logit: float = math.inf
    #: ... or at least this multiple of the lowest magnitude it had over its latest ``growth_window``
    #: logged steps without the finding (that lowest taken as 1 where smaller), and above
    #: ``attention_floor`` ...
    attention_growth: float = 20.0
    #: ... below which a max logit is never called growth: max logits start near 0.1 and grow
    #: tenfold as training begins, while attention stays soft.
    attention_floor: float = 10.0
    #: ``attention_entropy_collapse``: a module's (in the live logger: a head's) mean attention entropy is below
    #: this many nats (``exp(0.3)``: each query spreads its attention over about 1.35 keys) while its
    #: logits have grown ``attention_growth``-fold (a head that learned to copy with logits of the
    #: size it started with is not a collapse).
    attention_entropy: float = 0.3
    #: ``fp16_gradient_underflow``: with fp16 written by ``numerics=``, this fraction of a module's
    #: output gradient is lost to zero in fp16 at the step's loss scale (counted where a cast makes
    #: it zero; estimated from the share at fp16's smallest subnormal where it is fp16 already).
    fp16_gradient_underflow: float = 0.01
    #: ``fp8_underflow``: with e4m3 or e5m2 written, this fraction of what fp8 training casts of a
    #: watched Linear, its input or weight (e4m3) or its output gradient (e5m2), is lost to zero
    #: after scaling to its max |x| (per tensor; with ``fp8_scaling="rowwise"`` per row, the output
    #: gradient in e4m3 per row and per column) ...
    fp8_underflow: float = 0.01
    #: ... ``fp8_overflow``: more than this fraction becomes NaN/Inf in that cast.
    fp8_overflow: float = 0.0
    #: ``massive_activation``: with ``numerics=``, a module's max |output| is above this (Sun et
    #: al. 2024's 100) ...
    massive_activation: float = 100.0
    #: ... and above this multiple of the median |output| of the same tensor (their ~1,000).
    massive_ratio: float = 1000.0
    #: ``logit_drift``: with ``logits=``, a module's mean log-partition of its output logits is at
    #: least this many nats above the lowest it had over its latest ``growth_window`` logged steps
    #: without the finding (the partition function grew ``e**16``, 9 million-fold: more than a
    #: model learning its task needs, see ``docs/numerics.md``).
    logit_drift: float = 16.0

    def __post_init__(self) -> None:
        limits = {  # name: (low, high, low allowed, high allowed, integral, what is valid)
            "vanishing_ratio": (0.0, 1.0, True, False, False, "a fraction in [0, 1) (0: off)"),
            "exploding_update": (0.0, math.inf, False, True, False, "a positive number (inf: off)"),
            "exploding_growth": (1.0, math.inf, False, True, False, "a number above 1 (inf: off)"),
            "exploding_norm": (0.0, math.inf, False, True, False, "a positive number (inf: off)"),
            "growth_window": (1.0, math.inf, True, False, True, "a whole number of logged steps, at least 1"),
            "dead_fraction": (0.0, math.inf, False, True, False, "a fraction in (0, 1] (above 1: off)"),
            "zero_steps": (1.0, math.inf, True, False, True, "a whole number of logged steps, at least 1"),
            "amp_skipped_steps": (1.0, math.inf, True, True, True, "a whole number of logged steps >= 1 (inf: off)"),
            "attention_logit": (0.0, math.inf, False, True, False, "a positive number (inf: off)"),
            "attention_growth": (1.0, math.inf, False, True, False, "a number above 1 (inf: off)"),
            "attention_floor": (0.0, math.inf, True, False, False, "a finite number >= 0"),
            "attention_entropy": (0.0, math.inf, True, False, False, "a number of nats >= 0 (0: off)"),
            "fp16_gradient_underflow": (0.0, math.inf, False, True, False, "a fraction in (0, 1] (above 1: off)"),
            "fp8_underflow": (0.0, math.inf, False, True, False, "a fraction in (0, 1] (above 1: off)"),
            "fp8_overflow": (0.0, math.inf, True, True, False, "a fraction >= 0 (1 or more: off)"),
            "massive_activation": (0.0, math.inf, True, True, False, "a number >= 0 (inf: off)"),
            "massive_ratio": (1.0, math.inf, True, True, False, "a number >= 1 (inf: off)"),
            "logit_drift": (0.0, math.inf, False, True, False, "a positive number of nats (inf: off)"),
        }  # fmt: skip
        check_fields(self, limits)


#: A numeric field's valid range: (low, high, low allowed, high allowed, whole numbers only, what is valid).
Limit = tuple[float, float, bool, bool, bool, str]


def check_fields(config: object, limits: Mapping[str, Limit]) -> None:
    """Check each field of the frozen dataclass ``config`` against its :data:`Limit`, raising
    ``HookLoggerError`` naming the class, the field, the value and what is valid; NumPy scalars
    become plain numbers, whole numbers ints (but ``inf``)."""
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        low, high, low_ok, high_ok, integral, valid = limits[f.name]
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        if ok:
            number = float(value)
            ok = (low < number or (low_ok and number == low)) and (number < high or (high_ok and number == high))
            ok = ok and (not integral or number == math.inf or number.is_integer())
        if not ok:
            raise HookLoggerError(f"{type(config).__name__}({f.name}={value!r}) is invalid: it must be {valid}")
        object.__setattr__(config, f.name, int(number) if integral and number != math.inf else number)


@dataclass(frozen=True)
class Finding:
    """One problem, as it was when it started.

    Attributes:
        kind: what it is about, one of :data:`FINDING_KINDS` (``"vanishing_gradient"``, ...).
        module: the watched module it names (for some findings a parameter,
            ``{module}.{param}``); ``""`` when it is about the whole model.
        step: the step at which it started (TensorBoard's ``global_step``): a logged step, or for
            ``gradient_spike`` and ``loss_spike`` any step.
        value: the measured quantity its rule compared, e.g. the dead fraction or the NaN/Inf count
            (each kind's is in :data:`MEASURES`).
        message: one line saying what was found, as logged.
    """

    kind: str
    module: str
    step: int
    value: float
    message: str


Key = tuple[str, str]  # (kind, module or "" for the whole model)
#: Candidates of one step: the finding and whether its evidence is exactly zero.
Candidates = dict[Key, tuple[Finding, bool]]


class Trailing:
    """The latest ``window`` values of a series, and their median: what a value is compared with
    by the rules that judge a series against its own recent history."""

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self.values.append(value)

    def median(self) -> float:
        """The median of the values kept; NaN before the first."""
        return statistics.median(self.values) if self.values else math.nan

    def lowest(self) -> float:
        """The smallest of the values kept; NaN before the first."""
        return min(self.values) if self.values else math.nan

    def __len__(self) -> int:
        return len(self.values)


def started_line(new: Sequence[Finding]) -> str:
    """One line for the findings a step starts: per kind, how many and the worst few."""
    parts = []
    for kind, found in by_kind(new):
        if len(found) == 1:
            parts.append(f"{kind}: {found[0].message}")
            continue
        worst = ", ".join(f"{f.module} ({f.value:.3g})" for f in found[:LOG_WORST])
        more = f", +{len(found) - LOG_WORST} more" if len(found) > LOG_WORST else ""
        parts.append(f"{kind} in {count(found)}, worst: {worst}{more}")
    return "; ".join(parts)


def by_kind(found: Iterable[Finding]) -> list[tuple[str, list[Finding]]]:
    """Findings grouped by kind (in :data:`KINDS` order), the worst first within a kind."""
    groups: dict[str, list[Finding]] = {}
    for f in found:
        groups.setdefault(f.kind, []).append(f)
    # The smaller a vanishing ratio or an entropy, the worse; for the other kinds, the larger the value.
    return [
        (kind, sorted(groups[kind], key=lambda f: (f.value if kind in _SMALLER_IS_WORSE else -f.value, f.step)))
        for kind in FINDING_KINDS
        if kind in groups
    ]


def count(found: Sequence[Finding]) -> str:
    return f"{len(found)} module" + ("s" if len(found) > 1 else "")
