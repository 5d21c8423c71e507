"""The attention findings, from one step's ``attention/*`` scalars and, in the live logger, each
head's values (``StepSummary.heads``); and the layers x heads pictures of those values.

Host-side only. ``tblog-hooks report`` has the scalars only: it names the module, the live
logger also the head.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np

from ..stats.tags import Root, Stat, by_name, tag
from . import pictures

if TYPE_CHECKING:
    from .health import Finding, Thresholds

#: Per head of one module: the largest logit and the mean entropy (``stats.attention.Heads``).
Heads = tuple[np.ndarray, np.ndarray]
#: Earlier logged steps of a module the growth rule compares with (those without the finding).
WINDOW = 64
#: Max logits below this are never called growth: they start near 0.1 and grow tenfold as
#: training begins, while attention stays soft.
LOGIT_FLOOR = 10.0
#: The image tags of the per-head pictures.
PICTURES = {
    Stat.MAX_LOGIT: tag(Root.HEALTH, "attention_max_logit"),
    Stat.ENTROPY: tag(Root.HEALTH, "attention_entropy"),
}


class AttentionRules:
    """``attention_logit_growth`` and ``attention_entropy_collapse``; keeps the last
    :data:`WINDOW` max logits of each module."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self._history: dict[str, deque[float]] = {}

    def candidates(
        self, step: int, scalars: Mapping[str, float], heads: Mapping[str, Heads]
    ) -> dict[tuple[str, str], Finding] | None:
        """This step's attention findings, by (kind, module); ``None`` on a step without
        ``attention/*`` scalars (nothing to judge)."""
        from .health import ENTROPY_COLLAPSE, LOGIT_GROWTH, Finding

        t = self.thresholds
        peaks = by_name(scalars, Root.ATTENTION, Stat.MAX_LOGIT)
        if not peaks:
            return None
        found: dict[tuple[str, str], Finding] = {}
        for m, peak in peaks.items():
            history = self._history.setdefault(m, deque(maxlen=WINDOW))
            typical = statistics.median(history) if history else math.nan
            where = _head(heads.get(m), 0, np.argmax)
            reason = None
            if peak > t.attention_logit:
                reason = f"above {t.attention_logit:g}, where attention is effectively one-hot"
            elif peak > LOGIT_FLOOR and typical > 0 and peak > t.attention_growth * typical:
                reason = f"{peak / typical:.3g} times the median of its recent logged steps ({typical:.3g})"
            if reason is None:
                history.append(peak)
                continue
            message = f"the largest attention logit of {m}{where} is {peak:.3g}, {reason}"
            found[(LOGIT_GROWTH, m)] = Finding(LOGIT_GROWTH, m, step, peak, message)
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
                found[(ENTROPY_COLLAPSE, m)] = Finding(ENTROPY_COLLAPSE, m, step, lowest, message)
        return found


def _head(per_head: Heads | None, which: int, pick: object) -> str:
    """`` (head h)`` of the head ``pick`` chooses, with more than one head; else ``""``."""
    if per_head is None or per_head[which].size < 2:
        return ""
    return f" (head {int(pick(per_head[which]))})"  # type: ignore[operator]


def heads_pictures(heads: Mapping[str, Heads]) -> dict[str, np.ndarray]:
    """The ``layers x heads`` pictures of a step: one row per attention module (in call order),
    one column per head; the max logit on a log scale, the entropy (nats) on a linear one."""
    if not heads:
        return {}
    names = list(heads)
    width = max(h[0].size for h in heads.values())
    table = np.full((2, len(names), width), np.nan)
    for row, (peaks, entropies) in enumerate(heads.values()):
        table[0, row, : peaks.size], table[1, row, : entropies.size] = peaks, entropies
    return {
        PICTURES[Stat.MAX_LOGIT]: pictures.heads_grid(
            names, table[0], "max attention logit per layer and head", log=True
        ),
        PICTURES[Stat.ENTROPY]: pictures.heads_grid(
            names, table[1], "attention entropy (nats) per layer and head", log=False
        ),
    }
