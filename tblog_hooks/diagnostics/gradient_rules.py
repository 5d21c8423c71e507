"""The rules of a model's gradients and units: ``vanishing_gradient``, ``exploding_gradient``,
``dead_units``, ``nonfinite`` and ``amp_skipped_steps``, from one logged step's scalars.

They compare a model with itself (ratios along the forward order, growth over its own recent
steps, updates relative to the weights), never with fixed scales that depend on the loss, the
batch or the layer size; ``docs/health.md`` says why each default is what it is.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

from ..output.summary import Heads
from ..stats.tags import SCALE_TAG, SKIPPED_TAG, Root, Stat, by_name, tag
from .findings import DEAD, EXPLODING, NONFINITE, SKIPPING, VANISHING, Candidates, Finding, Thresholds, Trailing


class GradientRules:
    """Judges each logged step; keeps the largest norms of the latest ``growth_window`` steps
    without ``exploding_gradient`` and how many logged steps in a row the ``GradScaler`` skipped.
    A kind is only judged on a step that carries its evidence: a step the scaler skipped has no
    gradient norms, so the gradient findings (and ``nonfinite``: the scaler's overflow is
    expected) keep the state they had."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self._largest = Trailing(thresholds.growth_window)  # of recent steps without exploding
        self._skipped = 0  # consecutive logged steps the GradScaler skipped

    def judge(
        self, step: int, scalars: Mapping[str, float], order: Sequence[str], heads: Mapping[str, Heads]
    ) -> tuple[set[str], Candidates]:
        """The kinds this step judges, and its candidates."""
        skipped = scalars.get(SKIPPED_TAG, 0.0) > 0
        norms = [(m, v) for m in order if (v := scalars.get(tag(Root.GRADIENT, Stat.NORM, m))) is not None]
        finite = [(m, v) for m, v in norms if math.isfinite(v)]
        ratios = by_name(scalars, Root.PARAM, Stat.UPDATE_RATIO)
        candidates: Candidates = {}
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
            if self._skipped >= self.thresholds.amp_skipped_steps:
                scale = scalars.get(SCALE_TAG, math.nan)
                message = (
                    f"the GradScaler skipped the last {self._skipped} logged steps (inf/NaN gradients at every "
                    f"loss scale down to {scale:.3g}): the weights are not being updated"
                )
                candidates[(SKIPPING, "")] = (Finding(SKIPPING, "", step, float(self._skipped), message), False)
        return judged, candidates

    def _vanishing(self, step: int, norms: list[tuple[str, float]]) -> Candidates:
        """Modules that every gradient from the input up to them has left: the largest norm
        of the module and all modules before it in forward order is far below the largest in
        the model. Decay along the network, not a small module: a residual branch scaled
        down at init (layer scale, zero-initialised last norm) sits behind a trunk whose
        modules before it carry the full gradient."""
        top, largest = max(norms, key=lambda item: item[1])
        if largest <= 0:
            return {}
        limit = self.thresholds.vanishing_ratio * largest
        found: Candidates = {}
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

    def _exploding(self, step: int, norms: list[tuple[str, float]], ratios: Mapping[str, float]) -> Candidates:
        """The whole model: updates many times the weights, or a sudden growth of the largest norm."""
        t = self.thresholds
        found: Candidates = {}
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
        typical = self._largest.median()
        reason = None
        if largest > t.exploding_norm:
            reason = f"above {t.exploding_norm:g}"
        elif typical > 0 and largest > t.exploding_growth * typical:
            reason = f"{largest / typical:.3g} times the median of recent logged steps ({typical:.3g})"
        if reason is not None and not found:
            message = f"largest output-gradient norm ({top}: {largest:.3g}) is {reason}"
            found[(EXPLODING, "")] = (Finding(EXPLODING, top, step, largest, message), False)
        if not found:
            self._largest.add(largest)  # the typical scale is that of steps without this finding
        return found

    def _dead_units(self, step: int, scalars: Mapping[str, float], order: Sequence[str]) -> Candidates:
        """Modules whose units are never positive, except the last one that ran in this step
        (its units are outputs, e.g. classes). A module that ran is one with statistics of
        this step, so a watched module that never runs cannot take the output layer's place."""
        ran = [
            m
            for m in order
            if tag(Root.ACTIVATION, Stat.MEAN, m) in scalars or tag(Root.INPUT, Stat.NONFINITE, m) in scalars
        ]
        found: Candidates = {}
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
