"""Spikes between logged steps: every step's gradient norm and loss, judged on the host.

:class:`~tblog_hooks.capture.spikes.StepNorms` brings each step's per-module squared gradient
norms, their total and the loss to the host (a ring of the last ``Spikes.steps`` steps); here a
robust detector per series (the median and MAD of the log values over a trailing window, after a
warm-up) starts ``gradient_spike`` and ``loss_spike`` findings at the step of the spike. A gradient
spike is attributed to the watched module whose own norm rose most against its own recent
history; each module's own norm is judged too, by a stricter bar (:class:`ModuleDetectors`), so
that one layer's spike is found while the global norm barely moves. A non-finite global norm
starts ``nonfinite`` at its step. A step of a small batch (:class:`BatchSizes`) is not judged for
spikes. Every step's values become ``step/grad_norm``, ``step/loss`` and ``step/samples``; around a
spike the per-module norms become ``spike/grad_norm/{module}``. ``tblog-hooks report`` replays the
written series through the same :class:`Detector`, :class:`ModuleDetectors` and :func:`attribute`.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from ..errors import HookLoggerError
from ..keywords import keywords, switched
from ..stats.tags import GRAD_NORM_TAG, LOSS_TAG, SAMPLES_TAG, Root, Stat, by_name, tag
from .findings import Finding, FindingKind, Trailing, check_fields

#: A step with fewer samples than this fraction of the median of recent steps' (a small last batch
#: of an epoch, ``DataLoader(drop_last=False)``) is not judged: its gradient is mostly noise.
SMALL_BATCH = 0.5
#: Runners-up named in a ``gradient_spike`` message.
RUNNERS_UP = 3
#: The median absolute deviation of a normal distribution is this fraction of its standard deviation.
_MAD_TO_STD = 1.4826
#: Smallest spread of the log values the detector assumes (1%): a flat series (a clipped norm) is
#: not judged on rounding noise.
_MIN_SPREAD = 0.01


@keywords()
@dataclass(frozen=True)
class Spikes:
    """How ``HookLogger(spikes=...)`` watches every step's gradient norm and loss.

    The defaults were tuned on short healthy runs (see ``docs/spikes.md``). Each field is a
    keyword with a default. Its counts are optimizer steps (``step()`` calls), as
    ``HookLogger(every=)`` is, not logged steps: each series has one value per step.

    Raises:
        HookLoggerError: a field out of its range; the message names the field, the value and
            what is valid.
    """

    #: Optimizer steps whose per-module norms are kept (host ring), compared with for attribution
    #: and written as ``spike/grad_norm/{module}`` before a spike. Memory: this many floats per module.
    steps: int = 64
    #: Optimizer steps (the trailing values of a series) its median and MAD are taken over.
    window: int = 128
    #: Optimizer steps (values of a series) seen before it is judged (the first steps of a run are noisy).
    warmup: int = 20
    #: A spike is this many robust standard deviations (1.4826 MAD) above the median of the log values ...
    threshold: float = 6.0
    #: ... and at least this many times the median gradient norm ...
    grad_ratio: float = 3.0
    #: ... or, for the loss, this many times its median (a non-positive loss is not judged).
    loss_ratio: float = 1.3
    #: Each watched module's own gradient norm is judged too, ``threshold`` robust standard
    #: deviations and, a stricter bar than ``grad_ratio`` (there are many modules), at least this
    #: many times above its own median (``inf``: not judged).
    module_ratio: float = 10.0
    #: Optimizer steps after a spike logged in full (activations, output gradients, every histogram).
    after: int = 3

    def __post_init__(self) -> None:
        inf = math.inf
        check_fields(
            self,
            {  # name: (low, high, low allowed, high allowed, whole numbers only, what is valid)
                "steps": (2, inf, True, False, True, "a whole number of optimizer steps >= 2"),
                "window": (3, inf, True, False, True, "a whole number of optimizer steps >= 3"),
                "warmup": (3, inf, True, False, True, "a whole number of optimizer steps >= 3"),
                "threshold": (0, inf, False, False, False, "a finite number above 0"),
                "grad_ratio": (1, inf, True, False, False, "a finite number >= 1"),
                "loss_ratio": (1, inf, True, False, False, "a finite number >= 1"),
                "module_ratio": (1, inf, True, True, False, "a number >= 1 (inf: off)"),
                "after": (0, inf, True, False, True, "a whole number of optimizer steps >= 0"),
            },
        )
        if self.warmup > self.window:
            raise HookLoggerError(_warmup_past_window(self.window, self.warmup))


def _warmup_past_window(window: int, warmup: int) -> str:
    """The message for ``warmup > window``: it leads with the one the user gave (a value other
    than its default) and calls the other the default it is."""
    why = "a series is judged once `warmup` values were seen, on its last `window` values"
    if warmup == Spikes.warmup:  # (class attributes: the defaults)
        return (
            f"Spikes(window={window}) is smaller than the default warmup={warmup}: {why}; "
            f"pass window >= {warmup}, or warmup <= {window} as well"
        )
    other = "the default " if window == Spikes.window else ""
    return (
        f"Spikes(warmup={warmup}) is larger than {other}window={window}: {why}; "
        f"pass warmup <= {window}, or window >= {warmup} as well"
    )


def spikes_option(value: object) -> Spikes | None:
    """``HookLogger(spikes=...)`` as a :class:`Spikes` (``None``: off)."""
    return switched(value, Spikes, _not_spikes)


def _not_spikes(value: object) -> NoReturn:
    raise HookLoggerError(f"spikes must be True, a tblog_hooks.Spikes, or False or None (off), got {value!r}")


class Detector:
    """One series' spikes: a value whose log is more than ``threshold`` robust standard deviations
    and ``log(ratio)`` above the median of the trailing ``window`` log values, once ``warmup`` values
    were seen. A spike that lasts several steps is reported at its first step."""

    def __init__(self, config: Spikes, ratio: float) -> None:
        self._config, self._log_ratio = config, math.log(ratio)
        self._values = Trailing(config.window)
        self._in_spike = False

    def judge(self, value: float) -> tuple[float, float] | None:
        """Feed the next value; ``(value / median, median)`` if a spike starts with it.
        Non-finite and non-positive values are skipped."""
        if not (value > 0 and math.isfinite(value)):
            return None
        x = math.log(value)
        found = None
        if len(self._values) >= self._config.warmup:
            median = self._values.median()
            history = np.fromiter(self._values.values, dtype=np.float64, count=len(self._values))
            spread = max(_MAD_TO_STD * float(np.median(np.abs(history - median))), _MIN_SPREAD)
            rise = x - median
            spiking = rise > self._log_ratio and rise > self._config.threshold * spread
            if spiking and not self._in_spike:
                found = (math.exp(rise), math.exp(median))
            self._in_spike = spiking
        self._values.add(x)
        return found


class ModuleDetectors:
    """:class:`Detector` for each watched module's own norm, by the bar of ``threshold`` and
    ``module_ratio``, vectorised over the modules (a ring of ``window`` log values per module: two
    sorts of ``window x modules`` per step, whatever the number of parameters)."""

    def __init__(self, config: Spikes, width: int) -> None:
        self._config, self._log_ratio = config, math.log(config.module_ratio)
        self._on = math.isfinite(config.module_ratio)
        self._ring = np.full((config.window, width), np.inf)  # unfilled slots: +inf, sorted last
        self._next = np.zeros(width, dtype=np.int64)  # each column's next slot
        self._seen = np.zeros(width, dtype=np.int64)  # values in each column, up to window
        self._in_spike = np.zeros(width, dtype=bool)

    def reset(self) -> None:
        """Forget every value (a gap in the series: the report's history around spikes)."""
        self._ring.fill(np.inf)
        self._next.fill(0)
        self._seen.fill(0)
        self._in_spike.fill(False)

    def judge(self, norms: np.ndarray) -> list[tuple[int, float, float]]:
        """Feed each module's next norm (non-finite and non-positive ones skipped); ``[(index,
        norm / median, median)]`` of the modules whose spike starts with it, the largest rise first."""
        if not self._on:
            return []
        valid = (norms > 0) & np.isfinite(norms)
        with np.errstate(divide="ignore", invalid="ignore"):
            x = np.log(norms)
        judged = valid & (self._seen >= self._config.warmup)
        found = self._judged(x, judged) if judged.any() else []
        columns = np.flatnonzero(valid)
        self._ring[self._next[columns], columns] = x[columns]
        self._next[columns] = (self._next[columns] + 1) % self._config.window
        self._seen[columns] = np.minimum(self._seen[columns] + 1, self._config.window)
        return sorted(found, key=lambda item: -item[1])

    def _judged(self, x: np.ndarray, judged: np.ndarray) -> list[tuple[int, float, float]]:
        with np.errstate(invalid="ignore"):  # (columns without values: inf - inf)
            median = self._middle(np.sort(self._ring, axis=0))
            deviation = np.sort(np.abs(self._ring - median), axis=0)
        spread = np.maximum(_MAD_TO_STD * self._middle(deviation), _MIN_SPREAD)
        rise = x - median
        spiking = judged & (rise > self._log_ratio) & (rise > self._config.threshold * spread)
        starts = np.flatnonzero(spiking & ~self._in_spike)
        self._in_spike = np.where(judged, spiking, self._in_spike)
        return [(int(i), math.exp(rise[i]), math.exp(median[i])) for i in starts]

    def _middle(self, ordered: np.ndarray) -> np.ndarray:
        """Each column's median of its ``seen`` values, from the column sorted (unfilled slots last)."""
        seen = np.maximum(self._seen, 1)
        cols = np.arange(ordered.shape[1])
        with np.errstate(invalid="ignore"):
            return (ordered[(seen - 1) // 2, cols] + ordered[seen // 2, cols]) / 2  # type: ignore[no-any-return]


def attribute(now: Mapping[str, float], history: Mapping[str, Sequence[float]]) -> list[tuple[str, float]]:
    """Watched modules by how far their gradient norm ``now`` rose against the median of their own
    ``history`` (positive values only), the most first: ``[(module, now / median)]``. A module
    without history, or whose history is zero, rose infinitely if it is non-zero now."""
    rises = []
    for module, norm in now.items():
        if not math.isfinite(norm):
            continue
        past = [v for v in history.get(module, ()) if v > 0 and math.isfinite(v)]
        median = float(np.median(past)) if past else 0.0
        rises.append((module, norm / median if median > 0 else math.inf if norm > 0 else 0.0))
    return sorted(rises, key=lambda item: -item[1])


def gradient_finding(step: int, norm: float, ratio: float, median: float, rises: list[tuple[str, float]]) -> Finding:
    """The ``gradient_spike`` of ``step``, naming the module that rose most and the runners-up."""
    module, rise = rises[0] if rises else ("", math.nan)
    message = f"gradient norm {norm:.3g} is {ratio:.3g} times its median of recent steps ({median:.3g})"
    if rises:
        others = ", ".join(f"{m} ({r:.3g}x)" for m, r in rises[1 : 1 + RUNNERS_UP])
        message += f"; it rose most in {module} ({rise:.3g}x its own median)" + (f", then {others}" if others else "")
    return Finding(FindingKind.GRADIENT_SPIKE.value, module, step, ratio, message)


def nonfinite_finding(step: int, norm: float, norms: Mapping[str, float], order: Sequence[str]) -> Finding:
    """The ``nonfinite`` finding of a step whose gradient norm is not finite: it names the first
    module in forward order (``order``) whose own gradient norm is not, and the others."""
    bad = [m for m in order if m in norms and not math.isfinite(norms[m])]
    bad += sorted(m for m, v in norms.items() if not math.isfinite(v) and m not in bad)
    module = bad[0] if bad else ""
    message = f"the gradient norm is {norm:.3g} (not finite)"
    if bad:
        others = ", ".join(bad[1 : 1 + RUNNERS_UP]) + (", ..." if len(bad) > 1 + RUNNERS_UP else "")
        message += (
            f": the gradient of {module} is {norms[module]:.3g}, the first watched module in forward order whose "
            f"gradient is not finite" + (f" (then {others})" if others else "")
        )
    return Finding(FindingKind.NONFINITE.value, module, step, norms.get(module, norm), message)


def module_finding(
    step: int, norm: float, modules: Sequence[str], found: list[tuple[int, float, float]], norms: np.ndarray
) -> Finding:
    """The ``gradient_spike`` of ``step`` when only watched modules' own norms spiked (``found``,
    the largest rise first): it names the first; ``norm`` is the global norm."""
    index, ratio, median = found[0]
    module = modules[index]
    message = (
        f"the gradient norm of {module} is {norms[index]:.3g}, {ratio:.3g} times its own median of recent steps "
        f"({median:.3g}); the global gradient norm is {norm:.3g}"
    )
    others = ", ".join(f"{modules[i]} ({r:.3g}x)" for i, r, _ in found[1 : 1 + RUNNERS_UP])
    message += f"; also {others}" if others else ""
    return Finding(FindingKind.GRADIENT_SPIKE.value, module, step, ratio, message)


def loss_finding(step: int, loss: float, ratio: float, median: float) -> Finding:
    message = f"loss {loss:.4g} is {ratio:.3g} times its median of recent steps ({median:.4g})"
    return Finding(FindingKind.LOSS_SPIKE.value, "", step, ratio, message)


class BatchSizes:
    """The samples of recent steps: whether a step's batch is small against them."""

    def __init__(self, window: int) -> None:
        self._sizes = Trailing(window)

    def small(self, samples: float | None) -> bool:
        """Whether ``samples`` (``None``: not counted) is under :data:`SMALL_BATCH` times the
        median of the recent steps' (judged from the third step counted); then remember it."""
        if samples is None or not math.isfinite(samples):
            return False
        small = len(self._sizes) >= 2 and samples < SMALL_BATCH * self._sizes.median()
        self._sizes.add(int(samples))
        return small


class SpikeWatch:
    """The host side: each step's row (per-module squared norms, the loss) judged in step order;
    the findings and the series to write. ``order`` gives the watched modules in forward order
    (as far as known), for ``nonfinite``."""

    def __init__(
        self, config: Spikes, modules: Sequence[str], order: Callable[[], Sequence[str]] | None = None
    ) -> None:
        self.config, self.modules = config, tuple(modules)
        self._order = order or (lambda: self.modules)
        self._nonfinite = False  # the latest step read had a non-finite gradient norm
        self._grad = Detector(config, config.grad_ratio)
        self._loss = Detector(config, config.loss_ratio)
        self._modules = ModuleDetectors(config, len(self.modules))
        self._batches = BatchSizes(config.window)
        self._rows: deque[tuple[int, np.ndarray]] = deque(maxlen=config.steps)  # (step, per-module norms)
        self.pending: dict[int, dict[str, float]] = {}  # {step: {tag: value}} not written yet
        self._window_until = -1  # the last step written as spike/grad_norm/*
        self._after_until = -1  # spike/grad_norm/* is written up to this step (the steps after a spike)

    def feed(self, step: int, row: np.ndarray, loss_given: bool = True, samples: int | None = None) -> list[Finding]:
        """One step's row, ``[squared norm per module..., of the parameters no watched module
        owns, loss]`` (negative squares: not read; a NaN loss and not ``loss_given``: none) and its
        ``samples``; returns the findings that start at ``step``. Values are judged as written
        (float32), non-finite ones written too. A non-finite norm starts ``nonfinite`` (once for
        steps in a row that have one); a step of a small batch is not judged for spikes. The
        step's norm is the whole model's: the modules' and the other parameters'."""
        every = row[: len(self.modules) + 1].astype(np.float64)
        squares = every[:-1]
        read = not (every < 0).any()
        with np.errstate(invalid="ignore"):
            norms = np.sqrt(squares).astype(np.float32).astype(np.float64)
        total = float(np.float32(math.sqrt(every.sum()))) if read else math.nan
        loss = float(np.float32(row[-1]))
        values = self.pending.setdefault(step, {})
        if read:
            values[GRAD_NORM_TAG] = total
        if loss_given:
            values[LOSS_TAG] = loss
        if samples is not None:
            values[SAMPLES_TAG] = float(samples)
        found = []
        if read:
            if not math.isfinite(total) and not self._nonfinite:
                now = {m: float(norms[i]) for i, m in enumerate(self.modules)}
                found.append(nonfinite_finding(step, total, now, self._order()))
            self._nonfinite = not math.isfinite(total)
        if not self._batches.small(samples):
            found += self._spikes(step, total, norms if read else None, loss)
        if not read:
            return found
        self._rows.append((step, norms))
        if found:
            self._window(step)
        elif step <= self._after_until:
            self._add_norms(step, norms)
        return found

    def _spikes(self, step: int, total: float, norms: np.ndarray | None, loss: float) -> list[Finding]:
        """The spikes that start at ``step`` (``norms``: per module, ``None`` if not read)."""
        found = []
        grad = self._grad.judge(total)
        own = self._modules.judge(norms) if norms is not None else []
        if grad is not None and norms is not None:
            kept = [r for s, r in self._rows if s > step - self.config.steps]  # the steps the window writes
            history = {m: [float(r[i]) for r in kept] for i, m in enumerate(self.modules)}
            now = {m: float(norms[i]) for i, m in enumerate(self.modules)}
            found.append(gradient_finding(step, total, *grad, attribute(now, history)))
        elif own and norms is not None:
            found.append(module_finding(step, total, self.modules, own, norms))
        loss_spike = self._loss.judge(loss)
        if loss_spike is not None:
            found.append(loss_finding(step, loss, *loss_spike))
        return found

    def _window(self, step: int) -> None:
        """``spike/grad_norm/*`` for the kept steps up to ``step`` (those not written yet), and the next ones."""
        for s, norms in self._rows:
            if s > self._window_until:
                self._add_norms(s, norms)
        self._after_until = step + self.config.after

    def _add_norms(self, step: int, norms: np.ndarray) -> None:
        values = self.pending.setdefault(step, {})
        for m, v in zip(self.modules, norms.tolist()):
            values[tag(Root.SPIKE, Stat.GRAD_NORM, m)] = v
        self._window_until = max(self._window_until, step)

    def take(self) -> dict[int, dict[str, float]]:
        """The values not written yet, by step; forgets them."""
        pending, self.pending = {s: v for s, v in self.pending.items() if v}, {}
        return pending


def replay(
    series: Mapping[int, Mapping[str, float]], config: Spikes | None = None, order: Sequence[str] = ()
) -> list[Finding]:
    """The spike and ``nonfinite`` findings of written series (``{step: {tag: value}}``:
    ``step/grad_norm``, ``step/loss``, ``spike/grad_norm/{module}``), judged as the logger judged
    them (``order``: the watched modules in forward order). A module's own norm is written around
    spikes only: it is judged on the steps written before it, from the start of each stretch."""
    config = config or Spikes()
    grad, loss = Detector(config, config.grad_ratio), Detector(config, config.loss_ratio)
    named = {m for values in series.values() for m in by_name(values, Root.SPIKE, Stat.GRAD_NORM)}
    modules = [m for m in order if m in named] + sorted(named - set(order))
    own, last, batches = ModuleDetectors(config, len(modules)), -2, BatchSizes(config.window)
    found = []
    nonfinite = False
    for step in sorted(series):
        values = series[step]
        norm = values.get(GRAD_NORM_TAG, math.nan)
        now = by_name(values, Root.SPIKE, Stat.GRAD_NORM)
        if GRAD_NORM_TAG in values:
            if not math.isfinite(norm) and not nonfinite:
                found.append(nonfinite_finding(step, norm, now, order))
            nonfinite = not math.isfinite(norm)
        if now:  # (a stretch of written module norms goes on through a small batch)
            if step != last + 1:
                own.reset()
            last = step
        if batches.small(values.get(SAMPLES_TAG)):
            continue
        spiked: list[tuple[int, float, float]] = []
        if now:
            norms = np.array([now.get(m, math.nan) for m in modules])
            spiked = own.judge(norms)
        if (judged := grad.judge(norm)) is not None:
            history: dict[str, list[float]] = {}
            for s in range(step - config.steps + 1, step):
                for m, v in by_name(series.get(s, {}), Root.SPIKE, Stat.GRAD_NORM).items():
                    history.setdefault(m, []).append(v)
            found.append(gradient_finding(step, norm, *judged, attribute(now, history)))
        elif spiked:
            found.append(module_finding(step, norm, modules, spiked, norms))
        value = values.get(LOSS_TAG, math.nan)
        if (judged := loss.judge(value)) is not None:
            found.append(loss_finding(step, value, *judged))
    return found
