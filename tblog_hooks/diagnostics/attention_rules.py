"""The attention findings, from one step's ``attention/*`` scalars and, in the live logger, each
head's values (``StepSummary.heads``); and the layers x heads pictures of those values, with the
table of their numbers the dashboard draws.

Host-side only. ``tblog-hooks report`` has the scalars only: it names the module, the live
logger also the head.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..output.summary import Heads
from ..stats.tags import HEADS_TABLE_TAG, Root, Stat, by_name, names_tensor, rows_tag, tag
from . import pictures
from .findings import ENTROPY_COLLAPSE, LOGIT_GROWTH, Candidates, Finding, Thresholds, Trailing

#: The image tags of the per-head pictures.
PICTURES = {
    Stat.MAX_LOGIT: tag(Root.HEALTH, "attention_max_logit"),
    Stat.ENTROPY: tag(Root.HEALTH, "attention_entropy"),
}


#: The smallest baseline a layer's logit magnitude is compared with: below it attention is soft
#: (a logit of 1 weighs a key e times another of 0), and logits that start near 0.05 grow tenfold
#: as training begins without any instability.
SOFT_LOGIT = 1.0


class AttentionRules:
    """``attention_logit_growth`` and ``attention_entropy_collapse``, judged by each layer's course:
    the magnitude of its largest logit against the lowest it had over its latest ``growth_window``
    logged steps without the logit finding (a softmax does not see the logits' sign or offset, only
    their spread, so ``|max logit|``); an entropy is a collapse only where those logits grew."""

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
        growth: dict[str, float] = {}  # |max logit| over the layer's baseline (NaN before its first step)
        for m, peak in peaks.items():
            history = self._history.setdefault(m, Trailing(t.growth_window))
            size = abs(peak)
            base = max(history.lowest(), SOFT_LOGIT)  # (NaN stays NaN: nothing to compare with yet)
            growth[m] = size / base
            where = _head(heads.get(m), 0, lambda p: np.argmax(np.abs(p)))
            reason = None
            if size > t.attention_logit:
                reason = f"above {t.attention_logit:g}"
            elif size > t.attention_floor and growth[m] >= t.attention_growth:
                reason = f"{growth[m]:.3g} times the lowest of its recent logged steps ({base:.3g})"
            if reason is None:
                history.add(size)
                continue
            message = f"the largest attention logit of {m}{where} is {peak:.3g}: its magnitude is {reason}"
            found[(LOGIT_GROWTH, m)] = (Finding(LOGIT_GROWTH, m, step, peak, message), False)
        for m, mean in by_name(scalars, Root.ATTENTION, Stat.ENTROPY).items():
            lowest, where = mean, ""
            per_head = heads.get(m)
            if per_head is not None and np.isfinite(per_head[1]).any():
                lowest = float(np.nanmin(per_head[1]))
                where = _head(per_head, 1, np.nanargmin)
            grown = growth.get(m, math.nan)
            if lowest < t.attention_entropy and grown >= t.attention_growth:
                message = (
                    f"the attention of {m}{where} has a mean entropy of {lowest:.3g} nats (below "
                    f"{t.attention_entropy:g}) with logits {grown:.3g} times the magnitude of its recent "
                    "logged steps: each query attends to about one key, and the softmax passes almost no gradient"
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
        rows_tag(HEADS_TABLE_TAG): names_tensor(names),
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
