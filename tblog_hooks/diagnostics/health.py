"""Health findings: problems a user can act on, read off the statistics already logged.

Host-side only, from one logged step's scalars at a time: the logger feeds it each step it
writes, and ``tblog-hooks report`` replays a run's event files through the same code. Which
findings there are is up to the rules :class:`Health` is given (``gradient_rules.py``,
``attention_rules.py``, ``numerics_rules.py``, ``logit_rules.py``); :func:`default_health` gives it all of them.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Mapping, Sequence
from typing import Protocol

from ..output.summary import Heads
from ..stats.tags import Root, escape, tag
from .attention_rules import AttentionRules
from .findings import FINDING_KINDS, TABLE_ROWS, Candidates, Finding, Key, Thresholds, by_kind, count, log, started_line
from .gradient_rules import GradientRules
from .logit_rules import LogitRules
from .numerics_rules import NumericsRules


class Rule(Protocol):
    """What :class:`Health` asks of a rule, once per logged step."""

    def judge(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str], heads: Mapping[str, Heads]
    ) -> tuple[set[str], Candidates]:
        """The finding kinds this step carries evidence for, and the candidates among them."""


def default_health(thresholds: Thresholds, *, logs: bool = True) -> Health:
    """A :class:`Health` with every rule of the package (``logs``: see :class:`Health`)."""
    rules: list[Rule] = [
        GradientRules(thresholds),
        AttentionRules(thresholds),
        NumericsRules(thresholds),
        LogitRules(thresholds),
    ]
    return Health(thresholds, rules, logs=logs)


class Health:
    """Tracks which findings hold, step after step; each is reported once when it starts: listed
    in :attr:`started`, and with ``logs`` (the live logger) logged as a line of
    ``tblog_hooks.health``. A replay, which prints them itself, passes ``logs=False``: the choice
    is this instance's, whatever other threads judge meanwhile.

    Its state is bounded: the findings that hold, a streak count per candidate and what each
    rule keeps, whatever the length of the run."""

    def __init__(self, thresholds: Thresholds, rules: Sequence[Rule], *, logs: bool = True) -> None:
        self.thresholds = thresholds
        self.logs = logs
        self.rules = tuple(rules)
        self.active: dict[Key, Finding] = {}
        self.started: list[Finding] = []
        self._streaks: dict[Key, int] = {}  # consecutive judged steps each candidate held
        self._from_zero: set[Key] = set()  # candidates whose streak holds exactly-zero evidence
        self._spikes: deque[Finding] = deque(maxlen=TABLE_ROWS)  # the latest spike findings (text summary)
        self._spiked: list[Finding] = []  # spike findings since the last update ...
        self._spike_counts: Counter[str] = Counter()  # ... and by kind, those before it (health/{kind})

    def update(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str], heads: Mapping[str, Heads] | None = None
    ) -> list[Finding]:
        """Findings of one logged step's scalars (``order``: watched modules in forward order;
        ``heads``: per-head attention values, see ``attention_rules.py``); returns those that
        start now. A kind no rule judges at this step keeps the state it had."""
        self._spike_counts, self._spiked = Counter(f.kind for f in self._spiked), []
        judged: set[str] = set()
        candidates: Candidates = {}
        for rule in self.rules:
            kinds, found = rule.judge(step, scalars, order, heads or {})
            judged |= kinds
            candidates.update(found)
        return self._advance(step, judged, candidates)

    def spiked(self, found: Sequence[Finding]) -> None:
        """Spike findings of a step (``diagnostics/spikes.py``), which hold at their step only: listed,
        logged, and counted in ``health/{kind}`` of the next logged step written."""
        self.started += found
        self._spikes.extend(found)
        self._spiked += found
        if self.logs:
            log.warning("tblog_hooks: step %d: %s", found[0].step, started_line(found))

    def _advance(self, step: int, judged: set[str], candidates: Candidates) -> list[Finding]:
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
        if new and self.logs:
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
        for kind, found in by_kind([*self.active.values(), *self._spikes]):
            parts.append(
                f"**{kind}**: {count(found)}" + (f", the worst {TABLE_ROWS}" if len(found) > TABLE_ROWS else "")
            )
            rows = ["| module | since step | value | what it means |", "|---|---|---|---|"]
            rows += [f"| `{escape(f.module)}` | {f.step} | {f.value:.3g} | {f.message} |" for f in found[:TABLE_ROWS]]
            parts.append("\n".join(rows))
        return "\n\n".join(parts)
