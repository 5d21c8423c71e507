"""Turn one logged step's numbers (on the host) into TensorBoard scalars and histograms.

Several records of the same module in one step (a module called more than once, or
several forward/backward passes per optimizer step) are pooled as ``records.py`` declares,
so the statistics cover every call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import records, stats
from .records import ACTIVATION, COUNT, GRADIENT, HISTOGRAM, IMAGE, INPUT, PARAM_GRAD, SCALAR, HistMeta, Layout
from .tags import tag


@dataclass(frozen=True)
class Histogram:
    """A histogram in TensorBoard's terms: ``limits[i]`` is the right edge of bucket ``i``."""

    min: float
    max: float
    num: float
    sum: float
    sum_squares: float
    limits: list[float]
    counts: list[float]


@dataclass
class StepSummary:
    """Everything one logged step writes: ``{tag: value}``, ``{tag: Histogram}`` and
    ``{tag: uint8 image, channels first}``."""

    step: int
    scalars: dict[str, float]
    histograms: dict[str, Histogram]
    images: dict[str, np.ndarray] = field(default_factory=dict)


def summarize(step: int, values: np.ndarray, layout: Layout) -> StepSummary:
    """Decode the packed array of one step (see ``Collector.finish``) into tags."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf activations are data, not warnings
        scalars = records.scalars(layout.of(ACTIVATION, INPUT, GRADIENT, PARAM_GRAD, COUNT, SCALAR), values)
    images = {
        e.name: np.round(e.read(values)["pixels"].reshape(e.shape) * 255).astype(np.uint8) for e in layout.of(IMAGE)
    }
    histograms = {}
    for entry in layout.of(HISTOGRAM):
        histograms = _histograms(layout.hists, entry.read(values)["rows"].reshape(entry.shape))
    return StepSummary(step, scalars, histograms, images)


def _histograms(meta: list[HistMeta], rows: np.ndarray) -> dict[str, Histogram]:
    """One histogram per tag from its rows (calls of a module share their bucket edges). Each
    sampled count stands for ``elements / sampled`` elements, so ``num`` is the exact number of
    elements where no sampled element is NaN/Inf. Empty leading and trailing buckets are
    trimmed; histograms without a finite element dropped."""
    by_tag: dict[str, list[int]] = {}
    for i, m in enumerate(meta):
        by_tag.setdefault(tag(m.kind, m.name), []).append(i)
    weights = np.array([m.numel / m.sampled for m in meta])
    edges_at = np.arange(stats.BINS + 1) / stats.BINS
    out = {}
    for key, index in by_tag.items():
        counts = (rows[index, stats.HIST_WIDTH - stats.BINS :] * weights[index, None]).sum(axis=0)
        filled = np.flatnonzero(counts > 0)
        if not filled.size:
            continue  # no finite element
        start, half_span = rows[index[0], [stats.H_START, stats.H_HALF_SPAN]]
        edges = start + 2 * half_span * edges_at
        centres = (edges[:-1] + edges[1:]) / 2
        a, b = filled[0], filled[-1] + 1
        limits = edges[a + 1 : b + 1]
        if np.any(np.diff(limits) <= 0):  # a span below float resolution at this magnitude
            limits = _strictly_increasing(limits)
        out[key] = Histogram(
            min=float(rows[index, stats.H_MIN].min()),
            max=float(rows[index, stats.H_MAX].max()),
            num=float(counts.sum()),
            sum=float(counts @ centres),
            sum_squares=float(counts @ (centres * centres)),
            limits=limits.tolist(),
            counts=counts[a:b].tolist(),
        )
    return out


def _strictly_increasing(limits: np.ndarray) -> np.ndarray:
    """Nudge equal neighbours apart by one ulp: TensorBoard needs increasing bucket edges."""
    out = limits.copy()
    for i in range(1, out.size):
        out[i] = max(out[i], np.nextafter(out[i - 1], np.inf))
    return out
