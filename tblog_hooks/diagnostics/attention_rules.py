"""The attention findings, from one step's ``attention/*`` scalars and, in the live logger, each
head's values (``StepSummary.heads``); and the layers x heads pictures of those values, with the
table of their numbers the dashboard draws.

Host-side only. ``tblog-hooks report`` has the scalars only: it names the module, the live
logger also the head.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ..output.summary import Heads
from ..stats.tags import HEADS_TABLE_TAG, Root, Stat, by_name, escape, rows_tag, tag
from . import pictures
from .findings import ENTROPY_COLLAPSE, LOGIT_GROWTH, Candidates, Finding, Thresholds, Trailing

#: The image tags of the per-head pictures.
PICTURES = {
    Stat.MAX_LOGIT: tag(Root.HEALTH, "attention_max_logit"),
    Stat.ENTROPY: tag(Root.HEALTH, "attention_entropy"),
}


class AttentionRules:
    """``attention_logit_growth`` and ``attention_entropy_collapse``; keeps the latest
    ``growth_window`` max logits of each module (of steps without the finding)."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self._history: dict[str, Trailing] = {}

    def judge(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str], heads: Mapping[str, Heads]
    ) -> tuple[set[str], Candidates]:
        """This step's attention candidates; a step without ``attention/*`` scalars judges nothing."""
        t = self.thresholds
        peaks = by_name(scalars, Root.ATTENTION, Stat.MAX_LOGIT)
        if not peaks:
            return set(), {}
        found: Candidates = {}
        for m, peak in peaks.items():
            history = self._history.setdefault(m, Trailing(t.growth_window))
            typical = history.median()
            where = _head(heads.get(m), 0, np.argmax)
            reason = None
            if peak > t.attention_logit:
                reason = f"above {t.attention_logit:g}, where attention is effectively one-hot"
            elif peak > t.attention_floor and typical > 0 and peak > t.attention_growth * typical:
                reason = f"{peak / typical:.3g} times the median of its recent logged steps ({typical:.3g})"
            if reason is None:
                history.add(peak)
                continue
            message = f"the largest attention logit of {m}{where} is {peak:.3g}, {reason}"
            found[(LOGIT_GROWTH, m)] = (Finding(LOGIT_GROWTH, m, step, peak, message), False)
        for m, mean in by_name(scalars, Root.ATTENTION, Stat.ENTROPY).items():
            lowest, where = mean, ""
            per_head = heads.get(m)
            if per_head is not None and np.isfinite(per_head[1]).any():
                lowest = float(np.nanmin(per_head[1]))
                where = _head(per_head, 1, np.nanargmin)
            if lowest < t.attention_entropy:
                message = (
                    f"the attention of {m}{where} has a mean entropy of {lowest:.3g} nats (below "
                    f"{t.attention_entropy:g}): each query attends to about one key"
                )
                found[(ENTROPY_COLLAPSE, m)] = (Finding(ENTROPY_COLLAPSE, m, step, lowest, message), False)
        return {LOGIT_GROWTH, ENTROPY_COLLAPSE}, found


def _head(per_head: Heads | None, which: int, pick: object) -> str:
    """`` (head h)`` of the head ``pick`` chooses, with more than one head; else ``""``."""
    if per_head is None or per_head[which].size < 2:
        return ""
    return f" (head {int(pick(per_head[which]))})"  # type: ignore[operator]


def heads_table(heads: Mapping[str, Heads]) -> tuple[list[str], np.ndarray]:
    """The modules (in call order) and their ``2 x layers x heads`` values: each head's max logit,
    then its mean entropy; NaN past a module's last head."""
    names = list(heads)
    width = max((h[0].size for h in heads.values()), default=0)
    table = np.full((2, len(names), width), np.nan)
    for row, (peaks, entropies) in enumerate(heads.values()):
        table[0, row, : peaks.size], table[1, row, : entropies.size] = peaks, entropies
    return names, table


def heads_tensors(heads: Mapping[str, Heads]) -> dict[str, np.ndarray]:
    """The step's value table of the per-head pictures: float32 ``layers x heads x 2`` (max logit,
    entropy) and its rows' escaped module names."""
    if not heads:
        return {}
    names, table = heads_table(heads)
    return {
        HEADS_TABLE_TAG: table.transpose(1, 2, 0).astype(np.float32),
        rows_tag(HEADS_TABLE_TAG): np.array([escape(n) for n in names], dtype=object),
    }


def heads_pictures(heads: Mapping[str, Heads]) -> dict[str, np.ndarray]:
    """The ``layers x heads`` pictures of a step: one row per attention module (in call order),
    one column per head; the max logit on a log scale, the entropy (nats) on a linear one."""
    if not heads:
        return {}
    names, table = heads_table(heads)
    return {
        PICTURES[Stat.MAX_LOGIT]: pictures.heads_grid(
            names, table[0], "max attention logit per layer and head", log=True
        ),
        PICTURES[Stat.ENTROPY]: pictures.heads_grid(
            names, table[1], "attention entropy (nats) per layer and head", log=False
        ),
    }
