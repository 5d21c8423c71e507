"""Health findings: problems a user can act on, read off the statistics already logged.

Host-side only, from one logged step's scalars at a time: the logger feeds it each step it
writes, and ``tblog-hooks report`` replays a run's event files through the same code.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields

from .errors import HookLoggerError
from .tags import tag

VANISHING, EXPLODING, DEAD, NONFINITE = "vanishing_gradient", "exploding_gradient", "dead_units", "nonfinite"
KINDS = (VANISHING, EXPLODING, DEAD, NONFINITE)

#: Findings are reported here, once each when they start (WARNING level).
log = logging.getLogger("tblog_hooks.health")


@dataclass(frozen=True)
class Thresholds:
    """When a finding starts; the defaults stay quiet on a stock ResNet-18 (default init)."""

    #: ``vanishing_gradient``: a module's output-gradient norm is below this fraction of the
    #: largest one in the model at the same step (four orders of magnitude).
    vanishing_ratio: float = 1e-4
    #: ``exploding_gradient``: the largest output-gradient norm is above this ...
    exploding_norm: float = 1e3
    #: ... or above this multiple of the median of the largest norms of earlier logged steps
    #: (those without this finding).
    exploding_growth: float = 100.0
    #: ``dead_units``: this fraction of a module's channels (dim 1) is never positive across
    #: the batch (the last watched module in forward order, usually the output layer, is skipped).
    dead_fraction: float = 0.9

    def __post_init__(self) -> None:
        limits = {
            "vanishing_ratio": (0.0, 1.0, "a fraction in (0, 1)"),
            "exploding_norm": (0.0, math.inf, "a positive number"),
            "exploding_growth": (1.0, math.inf, "a number above 1"),
            "dead_fraction": (0.0, 1.0, "a fraction in (0, 1]"),
        }
        for f in fields(self):
            value = getattr(self, f.name)
            low, high, valid = limits[f.name]
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low < value < high
            if not ok and not (f.name == "dead_fraction" and value == 1.0):
                raise HookLoggerError(f"Thresholds({f.name}={value!r}) is invalid: it must be {valid}")


@dataclass(frozen=True)
class Finding:
    """One problem, as it was when it started."""

    kind: str
    module: str
    step: int
    value: float
    message: str


class Health:
    """Tracks which findings hold, step after step; each is reported once when it starts."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self.active: dict[tuple[str, str], Finding] = {}  # (kind, module or "" for the model) -> finding
        self.started: list[Finding] = []
        self._largest: list[float] = []  # largest output-gradient norm of earlier steps without exploding

    def update(self, step: int, scalars: Mapping[str, float], order: Sequence[str]) -> list[Finding]:
        """Findings of one logged step's scalars (``order``: watched modules in forward order);
        returns those that start now."""
        current = {**self._gradient_findings(step, scalars, order), **self._dead_units(step, scalars, order)}
        origin = _nonfinite_origin(step, scalars, order)
        if origin is not None:
            current[(NONFINITE, "")] = origin
        new = [finding for key, finding in current.items() if key not in self.active]
        # A finding that goes on keeps its start; one that stops is dropped, and reported again if it returns.
        self.active = {key: self.active.get(key, finding) for key, finding in current.items()}
        self.started += new
        for finding in new:
            log.warning("tblog_hooks: step %d: %s", finding.step, finding.message)
        return new

    def counts(self) -> dict[str, float]:
        """``health/{kind}``: how many findings of each kind hold now."""
        return {f"health/{kind}": float(sum(k == kind for k, _ in self.active)) for kind in KINDS}

    def table(self) -> str:
        """The current findings as a Markdown table."""
        if not self.active:
            return "No findings."
        rows = ["| finding | module | since step | value | what it means |", "|---|---|---|---|---|"]
        for f in sorted(self.active.values(), key=lambda f: (f.step, f.kind, f.module)):
            rows.append(f"| {f.kind} | `{f.module}` | {f.step} | {f.value:.3g} | {f.message} |")
        return "\n".join(rows)

    def _gradient_findings(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str]
    ) -> dict[tuple[str, str], Finding]:
        logged = {m: scalars.get(tag("gradient", "norm", m)) for m in order}
        norms = {m: v for m, v in logged.items() if v is not None and math.isfinite(v)}
        if not norms:
            return {}
        top = max(norms, key=norms.__getitem__)
        largest = norms[top]
        found = {}
        t = self.thresholds
        if largest > 0:
            for m, v in norms.items():
                if v < t.vanishing_ratio * largest:
                    message = (
                        f"output-gradient norm of {m} is {v:.3g}, below {t.vanishing_ratio:g} of the largest "
                        f"({top}: {largest:.3g})"
                    )
                    found[(VANISHING, m)] = Finding(VANISHING, m, step, v / largest, message)
        typical = statistics.median(self._largest) if self._largest else math.nan
        reason = None
        if largest > t.exploding_norm:
            reason = f"above {t.exploding_norm:g}"
        elif typical > 0 and largest > t.exploding_growth * typical:
            reason = f"{largest / typical:.3g} times the median of earlier logged steps ({typical:.3g})"
        if reason is None:
            self._largest.append(largest)  # the typical scale is that of steps without this finding
        else:
            message = f"largest output-gradient norm ({top}: {largest:.3g}) is {reason}"
            found[(EXPLODING, "")] = Finding(EXPLODING, top, step, largest, message)
        return found

    def _dead_units(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str]
    ) -> dict[tuple[str, str], Finding]:
        found = {}
        for m in order[:-1]:
            frac = scalars.get(tag("activation", "dead_frac", m))
            if frac is not None and frac >= self.thresholds.dead_fraction:
                message = f"{frac:.0%} of the channels of {m} are never positive across the batch"
                found[(DEAD, m)] = Finding(DEAD, m, step, frac, message)
        return found


def _nonfinite_origin(step: int, scalars: Mapping[str, float], order: Sequence[str]) -> Finding | None:
    """Where NaN/Inf start: the first module in forward order whose output is non-finite while
    its input is finite; without non-finite outputs, the last module in forward order (first
    in backward) whose output gradient is non-finite, then any non-finite parameter gradient."""
    bad_out = [m for m in order if scalars.get(tag("activation", "nonfinite", m), 0.0) > 0]
    for m in bad_out:
        if not scalars.get(tag("input", "nonfinite", m), 0.0) > 0:
            count = scalars[tag("activation", "nonfinite", m)]
            return Finding(
                NONFINITE, m, step, count, f"{count:.0f} NaN/Inf in the output of {m}, whose input was finite"
            )
    if bad_out:
        m = bad_out[0]
        return Finding(
            NONFINITE, m, step, scalars[tag("activation", "nonfinite", m)],
            f"NaN/Inf already in the input of {m}, the first module with a non-finite output: "
            "check the data (or code outside the watched modules)",
        )  # fmt: skip
    for m in reversed(order):
        count = scalars.get(tag("gradient", "nonfinite", m), 0.0)
        if count > 0:
            return Finding(
                NONFINITE, m, step, count, f"{count:.0f} NaN/Inf in the gradient w.r.t. the output of {m} (backward)"
            )
    for key, norm in scalars.items():
        if key.startswith("param_grad/norm/") and not math.isfinite(norm):
            name = key[len("param_grad/norm/") :]
            return Finding(NONFINITE, name, step, norm, f"the gradient of parameter {name} is not finite")
    return None
