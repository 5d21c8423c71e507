"""Turn one logged step's numbers (on the host) into TensorBoard scalars and histograms.

Several records of the same module in one step (a module called more than once, or
several forward/backward passes per optimizer step) are pooled as the logger's recipe
(``stats/recipe.py``) says, so the statistics cover every call; the recipe also says which
values carry a ``GradScaler``'s loss scale.
"""

from __future__ import annotations

import numpy as np

from ..stats import packing
from ..stats.binning import BINS, H_HALF_SPAN, H_MAX, H_MIN, H_START, HIST_WIDTH, RowInfo
from ..stats.packing import StepLayout
from ..stats.recipe import HISTOGRAM_SOURCES, LOSS_SCALED, Source
from ..stats.tags import tag
from .summary import Heads, Histogram, StepSummary


def summarize(step: int, values: np.ndarray, layout: StepLayout) -> StepSummary:
    """Decode the packed array of one step (see ``packing.pack_step``) into tags."""
    recipe = layout.recipe
    meaning: dict[str, packing.Meaning] = {}
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf activations are data, not warnings
        scalars = packing.scalars(layout.of(*recipe.scalar_kinds), values, meaning)
        attention, heads = attention_summary(layout, values)
        scalars.update(attention)
    images = {
        tag(e.kind.name, e.name): np.round(e.read(values)["pixels"].reshape(e.shape) * 255).astype(np.uint8)
        for e in layout.of(recipe[Source.IMAGE])
    }
    binned = [e.read(values)["rows"].reshape(e.shape) for e in layout.of(recipe[Source.BINNED])]
    histograms = decode_histograms(layout.rows, np.concatenate(binned)) if binned else {}
    sources = {k: s.value for s in LOSS_SCALED for k in recipe.scaled_by(s)}
    summary = StepSummary(step, scalars, histograms, images, heads)
    summary.scaled = {key: sources[k] for key, (k, m, _) in meaning.items() if m.scaled and k in sources}
    formats, casts = recipe.formats, recipe.casts
    summary.formats = {
        key: fmt for key, (kind, _, stat) in meaning.items() if (fmt := formats.get(kind, {}).get(stat)) is not None
    }
    summary.casts = frozenset(key for key in summary.formats if meaning[key][2] in casts.get(meaning[key][0], ()))
    summary.scaled_histograms = {
        tag(m.kind, m.name): HISTOGRAM_SOURCES[m.kind] for m in layout.rows if m.kind in HISTOGRAM_SOURCES
    }
    return summary


def attention_summary(layout: StepLayout, values: np.ndarray) -> tuple[dict[str, float], dict[str, Heads]]:
    """The ``attention/*`` scalars of a packed step, and per module (in the order of their first
    call) each head's largest logit and mean entropy (NaN for a head whose every query was masked out)."""
    entries = layout.of(layout.recipe[Source.ATTENTION])
    heads: dict[str, Heads] = {}
    for (_, name), (fields, _) in packing.pooled(entries, values).items():
        with np.errstate(invalid="ignore", divide="ignore"):
            heads[name] = (fields["max_logit"], fields["entropy"] / fields["queries"])
    return packing.scalars(entries, values), heads


def decode_histograms(meta: list[RowInfo], rows: np.ndarray) -> dict[str, Histogram]:
    """One histogram per tag from its rows (calls of a module share their bucket edges). Each
    sampled count stands for ``elements / sampled`` elements, so ``num`` is the exact number of
    elements where no sampled element is NaN/Inf. Empty leading and trailing buckets are
    trimmed; histograms without a finite element dropped."""
    tags: dict[str, int] = {}
    key = np.array([tags.setdefault(tag(m.kind, m.name), len(tags)) for m in meta])
    weights = np.array([m.numel / m.sampled if m.sampled else 0.0 for m in meta])  # (an empty piece's row)
    weighted = rows[:, HIST_WIDTH - BINS :] * weights[:, None]
    first = np.unique(key, return_index=True)[1]  # each tag's first row: its bucket edges
    if len(tags) == len(meta):
        counts, lows, highs = weighted, rows[:, H_MIN], rows[:, H_MAX]
    else:  # rows of one tag add up
        counts = np.zeros((len(tags), BINS))
        np.add.at(counts, key, weighted)
        lows, highs = np.full(len(tags), np.inf), np.full(len(tags), -np.inf)
        np.minimum.at(lows, key, rows[:, H_MIN])
        np.maximum.at(highs, key, rows[:, H_MAX])
    start, half_span = rows[first, H_START, None], rows[first, H_HALF_SPAN, None]
    edges = start + 2 * half_span * (np.arange(BINS + 1) / BINS)
    centres = (edges[:, :-1] + edges[:, 1:]) / 2
    filled = counts > 0
    a = filled.argmax(axis=1)
    b = BINS - filled[:, ::-1].argmax(axis=1)
    totals, sums, squares = counts.sum(axis=1), (counts * centres).sum(axis=1), (counts * centres**2).sum(axis=1)
    narrow = np.any(np.diff(edges, axis=1) <= 0, axis=1)  # a span below float resolution at this magnitude
    out = {}
    for name, i in tags.items():
        if not totals[i]:
            continue  # no finite element
        limits = edges[i, a[i] + 1 : b[i] + 1]
        out[name] = Histogram(
            min=float(lows[i]),
            max=float(highs[i]),
            num=float(totals[i]),
            sum=float(sums[i]),
            sum_squares=float(squares[i]),
            limits=(_strictly_increasing(limits) if narrow[i] else limits).tolist(),
            counts=counts[i, a[i] : b[i]].tolist(),
        )
    return out


def _strictly_increasing(limits: np.ndarray) -> np.ndarray:
    """Nudge equal neighbours apart by one ulp: TensorBoard needs increasing bucket edges."""
    out = limits.copy()
    for i in range(1, out.size):
        out[i] = max(out[i], np.nextafter(out[i - 1], np.inf))
    return out
