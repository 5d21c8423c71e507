"""The ``logit_drift`` finding (``logits=``), from one logged step's ``activation/log_z/*`` scalars:
a module's output logits whose log-partition ``log Z`` rises against its own recent course.

Cross-entropy does not see a shift of all logits, so nothing in the loss holds ``log Z`` in
place: a learning rate too high for the output layer makes it climb, and logits far from 0 lose
precision in bf16 and fp16 before the loss shows anything. z-loss (``w · mean(log² Z)`` added to the
loss; PaLM's ``w`` is 1e-4) holds it. Host-side only; ``tblog-hooks report`` replays it from the scalars.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..output.summary import Heads
from ..stats.tags import Root, Stat, by_name
from .findings import LOGIT_DRIFT, Candidates, Finding, Thresholds, Trailing

#: The z-loss weight the advice names: ten times PaLM's 1e-4 (Chowdhery et al. 2022), which holds
#: a slow drift over a long run but not a climb fast enough for this finding (``docs/numerics.md``).
Z_LOSS_WEIGHT = 1e-3


class LogitRules:
    """``logit_drift``: a module's mean ``log Z`` over tokens at least ``logit_drift`` nats above
    the lowest it had over its latest ``growth_window`` logged steps without the finding."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self._history: dict[str, Trailing] = {}

    def judge(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str], heads: Mapping[str, Heads]
    ) -> tuple[set[str], Candidates]:
        """This step's candidates; a step without ``activation/log_z/*`` judges nothing."""
        means = by_name(scalars, Root.ACTIVATION, Stat.LOG_Z)
        if not means:
            return set(), {}
        t = self.thresholds
        found: Candidates = {}
        for m, log_z in means.items():
            history = self._history.setdefault(m, Trailing(t.growth_window))
            lowest = history.lowest()
            rise = log_z - lowest  # (NaN before the first step: nothing to compare with yet)
            if not rise >= t.logit_drift:
                history.add(log_z)
                continue
            message = (
                f"the output logits of {m} drift upward: their log-partition log Σexp(z) is {log_z:.3g} nats on "
                f"average over tokens, {rise:.3g} above the lowest of its recent logged steps ({lowest:.3g}), "
                "which cross-entropy does not hold (a softmax ignores a shift of every logit): add a z-loss to the "
                f"loss, {Z_LOSS_WEIGHT:g} * torch.logsumexp(logits.float(), -1).square().mean() (PaLM's 1e-4 holds "
                "only a slow drift), or lower the output layer's learning rate"
            )
            found[(LOGIT_DRIFT, m)] = (Finding(LOGIT_DRIFT, m, step, log_z, message), False)
        return {LOGIT_DRIFT}, found
