"""Health findings: problems a user can act on, read off the statistics already logged.

Host-side only, from one logged step's scalars at a time: the logger feeds it each step it
writes, and ``tblog-hooks report`` replays a run's event files through the same code. The
rules compare a model with itself (ratios along the forward order, growth over its own recent
steps, updates relative to the weights), never with fixed scales that depend on the loss,
the batch or the layer size; ``docs/health.md`` says why each default is what it is.
"""

from __future__ import annotations

import enum
import logging
import math
import numbers
import statistics
from collections import Counter, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields

from ..errors import HookLoggerError
from ..stats.tags import Root, Stat, by_name, escape, tag
from ..transport.amp import SCALE_TAG, SKIPPED_TAG
from .attention_rules import AttentionRules, Heads


class FindingKind(enum.StrEnum):
    """What a :class:`Finding` is about (its ``kind``)."""

    VANISHING_GRADIENT = "vanishing_gradient"
    EXPLODING_GRADIENT = "exploding_gradient"
    DEAD_UNITS = "dead_units"
    NONFINITE = "nonfinite"
    AMP_SKIPPED_STEPS = "amp_skipped_steps"
    ATTENTION_LOGIT_GROWTH = "attention_logit_growth"
    ATTENTION_ENTROPY_COLLAPSE = "attention_entropy_collapse"
    #: With ``spikes=``: judged every step by ``diagnostics/spikes.py``; each starts and ends at its own step.
    GRADIENT_SPIKE = "gradient_spike"
    LOSS_SPIKE = "loss_spike"


#: Every finding kind, in the order tables list them.
FINDING_KINDS: tuple[str, ...] = tuple(kind.value for kind in FindingKind)
VANISHING, EXPLODING, DEAD, NONFINITE, SKIPPING = FINDING_KINDS[:5]
LOGIT_GROWTH, ENTROPY_COLLAPSE = FindingKind.ATTENTION_LOGIT_GROWTH.value, FindingKind.ATTENTION_ENTROPY_COLLAPSE.value
_SMALLER_IS_WORSE = (VANISHING, ENTROPY_COLLAPSE)  # finding kinds whose smaller values are worse
#: How many earlier logged steps the growth rule of ``exploding_gradient`` compares with (the
#: latest ones without that finding): a bounded window keeps the cost of a step constant.
GROWTH_WINDOW = 64
#: Modules named per kind in the log line (the worst ones) and rows per kind in the text summary.
LOG_WORST, TABLE_ROWS = 3, 20

#: Findings are reported here, one line per logged step that starts any (WARNING level).
log = logging.getLogger("tblog_hooks.health")


@dataclass(frozen=True)
class Thresholds:
    """When a finding starts. A rule is switched off by a value that is never crossed:
    ``vanishing_ratio=0``, ``math.inf`` for the others (``zero_steps`` is no rule of its own).

    Each field below is a keyword with a default; values are Python or NumPy numbers (not
    bools), and counts of logged steps are whole numbers.

    Raises:
        HookLoggerError: a field that is not such a number or is out of its range; the message
            names the field, the value and what is valid.
    """

    #: ``vanishing_gradient``: every output-gradient norm from the input up to a module (in
    #: forward order) is below this fraction of the largest one in the model at the same step.
    vanishing_ratio: float = 1e-4
    #: ``exploding_gradient``: with ``optimizer=``, the median update-to-weight ratio of the
    #: watched parameters is above this (the step moved the weights by many times their size) ...
    exploding_update: float = 10.0
    #: ... or the largest output-gradient norm is above this multiple of the median of the
    #: largest norms of the latest :data:`GROWTH_WINDOW` logged steps without this finding ...
    exploding_growth: float = 100.0
    #: ... or above this absolute value (off by default: norms scale with the loss reduction,
    #: batch and layer sizes, so no one number suits every model).
    exploding_norm: float = math.inf
    #: ``dead_units``: this fraction of a module's units (the channels of a convolution or a batch,
    #: instance or group norm, else the last dim of its output) is never positive across the batch
    #: (the last module that ran, in forward order, is skipped: usually the output layer).
    dead_fraction: float = 0.9
    #: Evidence that is exactly zero (a zero output, all gradients up to a module exactly zero) is
    #: what zero-initialised layers show before their first update: it must last this many logged steps.
    zero_steps: int = 3
    #: ``amp_skipped_steps``: the ``GradScaler`` skipped this many logged steps in a row.
    skipped_steps: float = 20
    #: ``attention_logit_growth``: with ``attention=``, a module's max attention logit is above this
    #: (a key whose logit is 30 above the others takes all the weight among 1e12 keys) ...
    attention_logit: float = 30.0
    #: ... or above this multiple of the median of its latest logged steps without the finding (and above 10).
    attention_growth: float = 100.0
    #: ``attention_entropy_collapse``: a module's (in the live logger: a head's) mean attention entropy is below
    #: this many nats (``exp(0.3)``: each query spreads its attention over about 1.35 keys).
    attention_entropy: float = 0.3

    def __post_init__(self) -> None:
        limits = {  # name: (low, high, low allowed, high allowed, integral, what is valid)
            "vanishing_ratio": (0.0, 1.0, True, False, False, "a fraction in [0, 1) (0: off)"),
            "exploding_update": (0.0, math.inf, False, True, False, "a positive number (inf: off)"),
            "exploding_growth": (1.0, math.inf, False, True, False, "a number above 1 (inf: off)"),
            "exploding_norm": (0.0, math.inf, False, True, False, "a positive number (inf: off)"),
            "dead_fraction": (0.0, math.inf, False, True, False, "a fraction in (0, 1] (above 1: off)"),
            "zero_steps": (1.0, math.inf, True, False, True, "a whole number of logged steps, at least 1"),
            "skipped_steps": (1.0, math.inf, True, True, True, "a whole number of logged steps, at least 1 (inf: off)"),
            "attention_logit": (0.0, math.inf, False, True, False, "a positive number (inf: off)"),
            "attention_growth": (1.0, math.inf, False, True, False, "a number above 1 (inf: off)"),
            "attention_entropy": (0.0, math.inf, True, False, False, "a number of nats >= 0 (0: off)"),
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
        value: the measured quantity its rule compared, e.g. the dead fraction or the NaN/Inf count.
        message: one line saying what was found, as logged.
    """

    kind: str
    module: str
    step: int
    value: float
    message: str


_Key = tuple[str, str]  # (kind, module or "" for the whole model)
#: Candidates of one step: the finding and whether its evidence is exactly zero.
_Candidates = dict[_Key, tuple[Finding, bool]]


class Health:
    """Tracks which findings hold, step after step; each is reported once when it starts.

    Its state is bounded: the findings that hold, a streak count per candidate and the
    :data:`GROWTH_WINDOW` latest largest norms, whatever the length of the run."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self.active: dict[_Key, Finding] = {}
        self.started: list[Finding] = []
        self._largest: deque[float] = deque(maxlen=GROWTH_WINDOW)  # of recent steps without exploding
        self._streaks: dict[_Key, int] = {}  # consecutive judged steps each candidate held
        self._from_zero: set[_Key] = set()  # candidates whose streak holds exactly-zero evidence
        self._skipped = 0  # consecutive logged steps the GradScaler skipped
        self._attention = AttentionRules(thresholds)
        self._spikes: deque[Finding] = deque(maxlen=TABLE_ROWS)  # the latest spike findings (text summary)
        self._spiked: list[Finding] = []  # spike findings since the last update ...
        self._spike_counts: Counter[str] = Counter()  # ... and by kind, those before it (health/{kind})

    def update(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str], heads: Mapping[str, Heads] | None = None
    ) -> list[Finding]:
        """Findings of one logged step's scalars (``order``: watched modules in forward order;
        ``heads``: per-head attention values, see ``attention_rules.py``);
        returns those that start now. A kind is only judged on a step that carries its evidence:
        a step the ``GradScaler`` skipped has no gradient norms, so the gradient findings (and
        ``nonfinite``: the scaler's overflow is expected) keep the state they had."""
        skipped = scalars.get(SKIPPED_TAG, 0.0) > 0
        norms = [(m, v) for m in order if (v := scalars.get(tag(Root.GRADIENT, Stat.NORM, m))) is not None]
        finite = [(m, v) for m, v in norms if math.isfinite(v)]
        ratios = by_name(scalars, Root.PARAM, Stat.UPDATE_RATIO)
        candidates: _Candidates = {}
        self._spike_counts, self._spiked = Counter(f.kind for f in self._spiked), []
        judged: set[str] = {DEAD}
        candidates.update(self._dead_units(step, scalars, order))
        if finite:
            judged.add(VANISHING)
            candidates.update(self._vanishing(step, finite))
        if finite or ratios:
            judged.add(EXPLODING)
            candidates.update(self._exploding(step, finite, ratios))
        if not skipped:
            judged.add(NONFINITE)
            origin = _nonfinite_origin(step, scalars, order)
            if origin is not None:
                candidates[(NONFINITE, "")] = (origin, False)
        if SKIPPED_TAG in scalars:
            judged.add(SKIPPING)
            self._skipped = self._skipped + 1 if skipped else 0
            if self._skipped >= self.thresholds.skipped_steps:
                scale = scalars.get(SCALE_TAG, math.nan)
                message = (
                    f"the GradScaler skipped the last {self._skipped} logged steps (inf/NaN gradients at every "
                    f"loss scale down to {scale:.3g}): the weights are not being updated"
                )
                candidates[(SKIPPING, "")] = (Finding(SKIPPING, "", step, float(self._skipped), message), False)
        attention = self._attention.candidates(step, scalars, heads or {})
        if attention is not None:
            judged |= {LOGIT_GROWTH, ENTROPY_COLLAPSE}
            candidates.update({key: (finding, False) for key, finding in attention.items()})
        return self._advance(step, judged, candidates)

    def spiked(self, found: Sequence[Finding]) -> None:
        """Spike findings of a step (``diagnostics/spikes.py``), which hold at their step only: listed,
        logged, and counted in ``health/{kind}`` of the next logged step written."""
        self.started += found
        self._spikes.extend(found)
        self._spiked += found
        log.warning("tblog_hooks: step %d: %s", found[0].step, started_line(found))

    def _advance(self, step: int, judged: set[str], candidates: _Candidates) -> list[Finding]:
        """Findings of judged kinds hold while their candidate does; others keep their state."""
        before = self._streaks
        self._streaks = {key: n for key, n in before.items() if key[0] not in judged}  # kinds not judged: as they were
        self._streaks.update({key: before.get(key, 0) + 1 for key in candidates})
        # A streak that began with exactly-zero evidence waits out zero_steps even once the
        # evidence turns small but non-zero: a zero-initialised layer grows out of zero gradually.
        self._from_zero = {key for key in self._from_zero if key in self._streaks} | {
            key for key, (_, zero) in candidates.items() if zero
        }
        # A finding that goes on keeps its start; one that stops is dropped, and reported again if it returns.
        active = {key: finding for key, finding in self.active.items() if key[0] not in judged or key in candidates}
        new = []
        for key, (finding, _) in candidates.items():
            patient = key not in self._from_zero or self._streaks[key] >= self.thresholds.zero_steps
            if key not in active and patient:
                active[key] = finding
                new.append(finding)
        self.active = active
        self.started += new
        if new:
            log.warning("tblog_hooks: step %d: %s", step, started_line(new))
        return new

    def counts(self) -> dict[str, float]:
        """``health/{kind}``: how many findings of each kind hold now (spikes: since the logged step before)."""
        return {
            tag(Root.HEALTH, kind): float(sum(k == kind for k, _ in self.active) + self._spike_counts[kind])
            for kind in FINDING_KINDS
        }

    def table(self) -> str:
        """The current findings as Markdown, one table per kind, worst first."""
        if not self.active and not self._spikes:
            return "No findings."
        parts = []
        for kind, found in _by_kind([*self.active.values(), *self._spikes]):
            parts.append(
                f"**{kind}**: {_count(found)}" + (f", the worst {TABLE_ROWS}" if len(found) > TABLE_ROWS else "")
            )
            rows = ["| module | since step | value | what it means |", "|---|---|---|---|"]
            rows += [f"| `{escape(f.module)}` | {f.step} | {f.value:.3g} | {f.message} |" for f in found[:TABLE_ROWS]]
            parts.append("\n".join(rows))
        return "\n\n".join(parts)

    def _vanishing(self, step: int, norms: list[tuple[str, float]]) -> _Candidates:
        """Modules that every gradient from the input up to them has left: the largest norm
        of the module and all modules before it in forward order is far below the largest in
        the model. Decay along the network, not a small module: a residual branch scaled
        down at init (layer scale, zero-initialised last norm) sits behind a trunk whose
        modules before it carry the full gradient."""
        top, largest = max(norms, key=lambda item: item[1])
        if largest <= 0:
            return {}
        limit = self.thresholds.vanishing_ratio * largest
        found: _Candidates = {}
        upstream = 0.0  # the largest norm from the input up to the module
        for m, v in norms:
            upstream = max(upstream, v)
            if upstream < limit:
                size = "exactly zero" if upstream == 0 else f"at most {upstream:.3g}"
                message = (
                    f"every output-gradient norm from the input up to {m} is {size}, below "
                    f"{self.thresholds.vanishing_ratio:g} of the largest ({top}: {largest:.3g})"
                )
                found[(VANISHING, m)] = (Finding(VANISHING, m, step, upstream / largest, message), upstream == 0)
        return found

    def _exploding(self, step: int, norms: list[tuple[str, float]], ratios: Mapping[str, float]) -> _Candidates:
        """The whole model: updates many times the weights, or a sudden growth of the largest norm."""
        t = self.thresholds
        found: _Candidates = {}
        finite = {name: r for name, r in ratios.items() if math.isfinite(r)}
        update = statistics.median(finite.values()) if finite else math.nan
        if update > t.exploding_update:
            worst = max(finite, key=finite.__getitem__)
            message = (
                f"the optimizer step changed half the watched parameters by more than {update:.3g} times their "
                f"norm (median update-to-weight ratio; largest {worst}: {finite[worst]:.3g}): the learning rate "
                "is too high for these gradients"
            )
            found[(EXPLODING, "")] = (Finding(EXPLODING, worst, step, update, message), False)
        if not norms:
            return found
        top, largest = max(norms, key=lambda item: item[1])
        typical = statistics.median(self._largest) if self._largest else math.nan
        reason = None
        if largest > t.exploding_norm:
            reason = f"above {t.exploding_norm:g}"
        elif typical > 0 and largest > t.exploding_growth * typical:
            reason = f"{largest / typical:.3g} times the median of recent logged steps ({typical:.3g})"
        if reason is not None and not found:
            message = f"largest output-gradient norm ({top}: {largest:.3g}) is {reason}"
            found[(EXPLODING, "")] = (Finding(EXPLODING, top, step, largest, message), False)
        if not found:
            self._largest.append(largest)  # the typical scale is that of steps without this finding
        return found

    def _dead_units(self, step: int, scalars: Mapping[str, float], order: Sequence[str]) -> _Candidates:
        """Modules whose units are never positive, except the last one that ran in this step
        (its units are outputs, e.g. classes). A module that ran is one with statistics of
        this step, so a watched module that never runs cannot take the output layer's place."""
        ran = [
            m
            for m in order
            if tag(Root.ACTIVATION, Stat.MEAN, m) in scalars or tag(Root.INPUT, Stat.NONFINITE, m) in scalars
        ]
        found: _Candidates = {}
        for m in ran[:-1]:
            frac = scalars.get(tag(Root.ACTIVATION, Stat.DEAD_FRAC, m))
            if frac is not None and frac >= self.thresholds.dead_fraction:
                lo, hi = scalars.get(tag(Root.ACTIVATION, Stat.MIN, m)), scalars.get(tag(Root.ACTIVATION, Stat.MAX, m))
                zero = lo == 0 == hi
                message = f"{frac:.0%} of the units of {m} are never positive across the batch" + (
                    " (its output is exactly zero)" if zero else ""
                )
                found[(DEAD, m)] = (Finding(DEAD, m, step, frac, message), zero)
        return found


def started_line(new: Sequence[Finding]) -> str:
    """One line for the findings a step starts: per kind, how many and the worst few."""
    parts = []
    for kind, found in _by_kind(new):
        if len(found) == 1:
            parts.append(f"{kind}: {found[0].message}")
            continue
        worst = ", ".join(f"{f.module} ({f.value:.3g})" for f in found[:LOG_WORST])
        more = f", +{len(found) - LOG_WORST} more" if len(found) > LOG_WORST else ""
        parts.append(f"{kind} in {_count(found)}, worst: {worst}{more}")
    return "; ".join(parts)


def _by_kind(found: Iterable[Finding]) -> list[tuple[str, list[Finding]]]:
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


def _count(found: Sequence[Finding]) -> str:
    return f"{len(found)} module" + ("s" if len(found) > 1 else "")


def _nonfinite_origin(step: int, scalars: Mapping[str, float], order: Sequence[str]) -> Finding | None:
    """Where NaN/Inf start: the first module in forward order whose output is non-finite while
    its input is finite; without non-finite outputs, the last module in forward order (first
    in backward) whose output gradient is non-finite, then any non-finite parameter gradient."""
    outputs = {m: scalars.get(tag(Root.ACTIVATION, Stat.NONFINITE, m), 0.0) for m in order}
    bad_out = [m for m in order if outputs[m] > 0]
    for m in bad_out:
        if not scalars.get(tag(Root.INPUT, Stat.NONFINITE, m), 0.0) > 0:
            count = outputs[m]
            return Finding(
                NONFINITE, m, step, count, f"{count:.0f} NaN/Inf in the output of {m}, whose input was finite"
            )
    if bad_out:
        m = bad_out[0]
        return Finding(
            NONFINITE, m, step, outputs[m],
            f"NaN/Inf already in the input of {m}, the first module with a non-finite output: "
            "check the data (or code outside the watched modules)",
        )  # fmt: skip
    for m in reversed(order):
        count = scalars.get(tag(Root.GRADIENT, Stat.NONFINITE, m), 0.0)
        if count > 0:
            return Finding(
                NONFINITE, m, step, count, f"{count:.0f} NaN/Inf in the gradient w.r.t. the output of {m} (backward)"
            )
    for name, norm in by_name(scalars, Root.PARAM_GRAD, Stat.NORM).items():
        if not math.isfinite(norm):
            return Finding(NONFINITE, name, step, norm, f"the gradient of parameter {name} is not finite")
    return None
