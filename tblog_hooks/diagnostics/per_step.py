"""What the logger adds to each step it writes: health findings and ``health/*`` scalars, the
gradient-flow heatmap, the per-head and per-format pictures with their value tables, the forward
order, the custom-scalars layout (once) and the text summaries.

Host-side only: it reads the :class:`~tblog_hooks.output.summary.StepSummary` the step already
produced, so diagnostics cost no device work.
"""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ..output.summary import StepSummary
from ..stats.tags import (
    ORDER_TAG,
    TABLE_PLUGIN,
    Indexed,
    Root,
    Stat,
    by_name,
    names_tensor,
    order_markdown,
    tag,
    unescape,
)
from . import pictures
from .attention_rules import heads_pictures, heads_tensors
from .findings import Thresholds
from .health import default_health
from .numerics_rules import numerics_pictures, numerics_tensors

if TYPE_CHECKING:
    from ..output.destination import Destination

FLOW_TAG, FINDINGS_TAG = tag(Root.HEALTH, "gradient_flow"), tag(Root.HEALTH, "findings")
_GLOBAL_NORM = tag(Root.PARAM_GRAD, Stat.GLOBAL_NORM)
#: The heatmap (and with ``numerics=`` the modules x formats pictures) is drawn on the first logged
#: step, then every this many logged steps, and at close: drawing and encoding it on every logged
#: step would cost more than the statistics.
FLOW_EVERY = 10
#: Most rows of the heatmap; more watched modules share rows (see :func:`gradient_flow_image`).
MAX_ROWS = 128
#: Most lines of one custom-scalars chart: TensorBoard's server answers a chart in time linear in
#: its lines (~50 ms each at 7,000 tags) and refuses request URLs over 64 kB (~1,000 lines).
MAX_CHART_LINES = 64


class Diagnostics:
    """Fed every written step, in step order; keeps the last :data:`pictures.MAX_COLUMNS`
    steps of gradient norms for the heatmap."""

    def __init__(self, modules: Sequence[str], forward_order: list[str], thresholds: Thresholds | None) -> None:
        self._modules = tuple(modules)
        self._forward_order = forward_order  # filled by the collector as forward hooks first fire
        self.health = None if thresholds is None else default_health(thresholds)
        self._norms: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._written_order: list[str] | None = None
        #: The scalar tags the custom-scalars layout charts: every one written so far, in first-written order.
        self._charted: dict[str, None] = {}
        self._written_table: str | None = None
        self._numbers: dict[str, float] = {}  # summary() numbers of the latest written step that had them
        self._drawn = False
        self._undrawn = 0  # logged steps with gradient norms since the heatmap was last drawn
        self._numerics_steps = 0  # logged steps with numerics= values
        # The latest of them, when its pictures were not drawn: its step and values.
        self._undrawn_numerics: tuple[int, dict[str, float]] | None = None
        self._failed = False

    def order(self) -> list[str]:
        """Watched modules in forward order; those that never ran last, in model order."""
        fired = set(self._forward_order)
        return list(self._forward_order) + [m for m in self._modules if m not in fired]

    def write(self, writer: Destination, summary: StepSummary) -> None:
        """Add findings, the heatmap and the forward order when it changed to ``summary``, write
        it, then the text summaries. A failure here is reported once and switches the diagnostics
        off, not the statistics."""
        order = self.order()
        scalars = Indexed(summary.scalars)  # (each rule's look-up of a statistic costs its own tags)
        norms = gradient_norms(scalars)
        if not self._failed:
            try:
                self._annotate(summary, scalars, order, norms)
            except Exception as error:
                self._fail(error)
        if not self._failed and order != self._written_order:
            summary.tensors[ORDER_TAG] = names_tensor(order)
        writer.write(summary)
        self._remember(summary.scalars, norms)
        if not self._failed:
            self._write_text(writer, summary, order)
        writer.flush()  # once per logged step: a crash loses at most the step in flight

    def close(self, writer: Destination) -> None:
        """Draw the heatmap and the numerics pictures of the last written step, if newer steps
        came since they were drawn."""
        if self._failed:
            return
        try:
            drawn = []
            if self._undrawn:
                drawn.append((next(reversed(self._norms)), {FLOW_TAG: gradient_flow_image(self.order(), self._norms)}))
            if self._undrawn_numerics is not None:
                step, every = self._undrawn_numerics
                drawn.append((step, numerics_pictures(self.order(), every)))
        except Exception as error:
            self._fail(error)
            return
        for step, images in drawn:
            writer.write(StepSummary(step, {}, {}, images))
        self._undrawn, self._undrawn_numerics = 0, None

    def _fail(self, error: BaseException) -> None:
        self._failed = True
        warnings.warn(
            f"tblog_hooks: diagnostics failed and are switched off (statistics are still written): "
            f"{type(error).__name__}: {error}",
            RuntimeWarning,
            stacklevel=3,
        )

    def _write_text(self, writer: Destination, summary: StepSummary, order: list[str]) -> None:
        """The custom-scalars layout when the run writes a scalar it does not chart yet (a first
        step the ``GradScaler`` skipped writes no gradient statistics, a spike's tags come later);
        the forward order (as Markdown, for the Text tab) and findings when they change."""
        step = summary.step
        new = [key for key in summary.scalars if key not in self._charted and "/" in key]
        if new:
            self._charted.update(dict.fromkeys(new))
            writer.add_custom_scalars(custom_scalars_layout(self._charted, order))
        if order != self._written_order:
            writer.add_text(ORDER_TAG, order_markdown(order), step)
            self._written_order = order
        table = None if self.health is None else self.health.table()
        if table is not None and table != self._written_table:
            self._written_table = table
            # Module names are user data: a lone surrogate could not be encoded as UTF-8.
            writer.add_text(FINDINGS_TAG, self._written_table.encode("utf-8", "backslashreplace").decode(), step)

    def _annotate(self, summary: StepSummary, scalars: Indexed, order: list[str], norms: dict[str, float]) -> None:
        """Findings and ``health/*`` scalars (of ``scalars``, the summary's, indexed), and the
        heatmap of the output-gradient ``norms``, into ``summary``."""
        if self.health is not None:
            self.health.update(summary.step, scalars, order, summary.heads)
            summary.scalars.update(self.health.counts())
        summary.images.update(heads_pictures(summary.heads))
        summary.tensors.update(heads_tensors(summary.heads))
        if (
            summary.numerics
        ):  # the table every logged step; the pictures drawn as the heatmap is, and for the same reason
            summary.tensors.update(numerics_tensors(order, summary.numerics))
            if self._numerics_steps % FLOW_EVERY == 0:
                summary.images.update(numerics_pictures(order, summary.numerics))
                self._undrawn_numerics = None
            else:
                self._undrawn_numerics = (summary.step, summary.numerics)
            self._numerics_steps += 1
        if norms:
            self._norms[summary.step] = norms
            while len(self._norms) > pictures.MAX_COLUMNS:
                self._norms.popitem(last=False)
            self._undrawn += 1
            if not self._drawn or self._undrawn >= FLOW_EVERY:
                summary.images[FLOW_TAG] = gradient_flow_image(order, self._norms)
                self._drawn, self._undrawn = True, 0

    def summary(self) -> dict[str, float]:
        """Progress-bar numbers of the latest written step (see ``HookLogger.summary``); a step
        without gradients (one the ``GradScaler`` skipped) keeps those of the step before."""
        out = dict(self._numbers)
        if self.health is not None:
            out["findings"] = len(self.health.active)
        return out

    def _remember(self, scalars: Mapping[str, float], norms: dict[str, float]) -> None:
        if _GLOBAL_NORM in scalars:
            self._numbers["grad_norm"] = scalars[_GLOBAL_NORM]
        if norms:
            self._numbers["min_layer_grad"] = min(norms.values())


def gradient_norms(scalars: Mapping[str, float]) -> dict[str, float]:
    """``{module: output-gradient norm}`` of one step."""
    return by_name(scalars, Root.GRADIENT, Stat.NORM)


def gradient_flow_image(order: Sequence[str], norms: Mapping[int, Mapping[str, float]]) -> np.ndarray:
    """The heatmap of ``{step: {module: norm}}``, rows in ``order`` (modules with a norm only).
    Above :data:`MAX_ROWS` modules, consecutive modules share a row showing their smallest norm
    (where a gradient vanishes first; red if any is NaN/Inf), so a deep model's picture keeps
    a readable size and still shows the trend over depth."""
    rows = [m for m in order if any(m in by_module for by_module in norms.values())]
    steps = sorted(norms)
    shape = (len(rows), len(steps))
    table = np.array([[norms[s].get(m, np.nan) for s in steps] for m in rows], dtype=np.float64).reshape(shape)
    logged = np.array([[m in norms[s] for s in steps] for m in rows], dtype=bool).reshape(shape)
    if len(rows) <= MAX_ROWS:
        return pictures.gradient_flow(rows, steps, table, logged)
    groups = np.array_split(np.arange(len(rows)), MAX_ROWS)
    labels = [rows[g[0]] if len(g) == 1 else f"{rows[g[0]]} (+{len(g) - 1})" for g in groups]
    bad = logged & ~np.isfinite(table)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN groups (no module logged at a step)
        smallest = np.stack([np.nanmin(np.where(bad[g], np.nan, table[g]), axis=0) for g in groups])
    smallest[np.stack([bad[g].any(axis=0) for g in groups])] = np.nan  # NaN/Inf anywhere: red
    return pictures.gradient_flow(labels, steps, smallest, np.stack([logged[g].any(axis=0) for g in groups]))


def custom_scalars_layout(scalars: Iterable[str], order: Sequence[str]) -> dict[str, dict[str, list[object]]]:
    """One multi-line chart per quantity (``activation/std``, ``gradient/norm``, ...) holding
    every watched module or parameter, in forward order; split into charts of at most
    :data:`MAX_CHART_LINES` lines for a deep model."""
    rank = {m: i for i, m in enumerate(order)}
    charts: dict[str, list[str]] = {}
    for key in scalars:
        quantity = key.rpartition("/")[0]
        if quantity:
            charts.setdefault(quantity, []).append(key)

    def position(key: str) -> int:  # sorted() is stable: parameters of a module keep their order
        item = unescape(key.rpartition("/")[2])
        owner = max((m for m in rank if item == m or item.startswith(m + ".")), key=len, default=None)
        return len(rank) if owner is None else rank[owner]

    layout: dict[str, list[object]] = {}
    for quantity, tags in sorted(charts.items()):
        ordered = [f"^{re.escape(t)}$" for t in sorted(tags, key=position)]
        if len(ordered) <= MAX_CHART_LINES:
            layout[quantity] = ["Multiline", ordered]
            continue
        for start in range(0, len(ordered), MAX_CHART_LINES):  # consecutive in forward order
            part = ordered[start : start + MAX_CHART_LINES]
            layout[f"{quantity} ({start + 1}-{start + len(part)} of {len(ordered)})"] = ["Multiline", part]
    return {TABLE_PLUGIN: layout}
