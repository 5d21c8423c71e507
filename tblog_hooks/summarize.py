"""Turn one logged step's numbers (on the host) into TensorBoard scalars and histograms.

Several records of the same module in one step (a module called more than once, or
several forward/backward passes per optimizer step) are merged here: counts and sums
add up, minima and maxima combine, so the statistics cover every call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import stats
from .collect import ACTIVATION, GRADIENT, INPUT, PARAM_GRAD, Layout
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
    act_floats, act_counts, grad_norms, grad_nonfinite, param_norms, in_floats, in_counts, extras, hists = np.split(
        values, np.cumsum(layout.sizes())
    )

    scalars: dict[str, float] = {}
    for kind, entries, floats, counts in (
        (ACTIVATION, layout.activations, act_floats, act_counts),
        (INPUT, layout.inputs, in_floats, in_counts),
    ):
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf activations are data, not warnings
            pooled = _merge_activations(entries, floats.reshape(-1, 4), counts.reshape(-1, 3))
        for name, moments in pooled.items():
            scalars.update({tag(kind, stat, name): value for stat, value in moments.items()})
    squares: dict[str, float] = {}
    nonfinite: dict[str, float] = {}
    for name, norm, bad in zip(layout.gradients, grad_norms, grad_nonfinite):
        squares[name] = squares.get(name, 0.0) + float(norm) ** 2
        nonfinite[name] = nonfinite.get(name, 0.0) + float(bad)
    for name, square in squares.items():
        scalars[tag(GRADIENT, "norm", name)] = math.sqrt(square)
        scalars[tag(GRADIENT, "nonfinite", name)] = nonfinite[name]
    for key, norm in zip(layout.params, param_norms):
        scalars[tag(PARAM_GRAD, "norm", key)] = float(norm)
    if layout.params:
        scalars[tag(PARAM_GRAD, "global_norm")] = math.sqrt(float(np.sum(np.square(param_norms))))

    histograms = _histograms(layout.hists, layout.hist_weights, hists.reshape(-1, stats.HIST_WIDTH))
    images = {}
    offset = 0
    for key, shape in layout.extras:
        size = math.prod(shape)
        value = extras[offset : offset + size]
        offset += size
        if not shape:  # a scalar; left out where undefined (update ratio of an all-zero weight)
            if math.isfinite(value[0]):
                scalars[key] = float(value[0])
        else:  # an image with values in [0, 1]
            images[key] = np.round(value.reshape(shape) * 255).astype(np.uint8)
    return StepSummary(step, scalars, histograms, images)


def _merge_activations(
    entries: list[tuple[str, int, int]], floats: np.ndarray, counts: np.ndarray
) -> dict[str, dict[str, float]]:
    """Pool every call of a module in the step (Chan et al.'s parallel variance)."""
    pooled: dict[str, list[float]] = {}  # name -> [n, mean, m2, min, max, nonzero, nonfinite, dead, channels]
    for (name, n, chans), (mean, centred, lo, hi), (nonzero, bad, dead) in zip(entries, floats, counts):
        m2 = centred * centred
        acc = pooled.get(name)
        if acc is None:
            pooled[name] = [float(n), mean, m2, lo, hi, nonzero, bad, dead, float(chans)]
            continue
        total = acc[0] + n
        delta = mean - acc[1]
        acc[2] += m2 + delta * delta * acc[0] * n / total
        acc[1] += delta * n / total
        acc[0] = total
        acc[3], acc[4] = np.minimum(acc[3], lo), np.maximum(acc[4], hi)  # NaN propagates, as in torch.aminmax
        for i, value in ((5, nonzero), (6, bad), (7, dead), (8, chans)):
            acc[i] += value
    out = {}
    for name, (count, mean, m2, lo, hi, nonzero, bad, dead, channel_total) in pooled.items():
        moments = {
            "mean": mean,
            "std": math.sqrt(m2 / (count - 1)) if count > 1 else 0.0,  # unbiased, as torch.std
            "min": lo,
            "max": hi,
            "zero_frac": (count - nonzero) / count,
            "nonfinite": bad,
        }
        if channel_total:
            moments["dead_frac"] = dead / channel_total
        out[name] = {stat: float(value) for stat, value in moments.items()}
    return out


def _histograms(keys: list[tuple[str, str]], weights: list[float], rows: np.ndarray) -> dict[str, Histogram]:
    """Histograms with empty leading and trailing buckets trimmed; all-empty ones dropped.
    Counts of subsampled tensors are scaled by ``weights`` to stand for every element."""
    counts = rows[:, 4:] * np.asarray(weights)[:, None]
    steps = np.arange(stats.BINS + 1) / stats.BINS
    edges = rows[:, stats.H_LO, None] + rows[:, stats.H_SPAN, None] * steps
    centres = (edges[:, :-1] + edges[:, 1:]) / 2
    filled = counts > 0
    first = filled.argmax(axis=1)
    last = stats.BINS - filled[:, ::-1].argmax(axis=1)
    totals = counts.sum(axis=1)
    sums = (counts * centres).sum(axis=1)
    squares = (counts * centres * centres).sum(axis=1)
    out = {}
    for i, (kind, name) in enumerate(keys):
        if totals[i] == 0:
            continue  # no finite element
        a, b = first[i], last[i]
        limits = edges[i, a + 1 : b + 1]
        if np.any(np.diff(limits) <= 0):  # a span below float resolution at this magnitude
            limits = _strictly_increasing(limits)
        out[tag(kind, name)] = Histogram(
            min=float(rows[i, stats.H_MIN]),
            max=float(rows[i, stats.H_MAX]),
            num=float(totals[i]),
            sum=float(sums[i]),
            sum_squares=float(squares[i]),
            limits=limits.tolist(),
            counts=counts[i, a:b].tolist(),
        )
    return out


def _strictly_increasing(limits: np.ndarray) -> np.ndarray:
    """Nudge equal neighbours apart by one ulp: TensorBoard needs increasing bucket edges."""
    out = limits.copy()
    for i in range(1, out.size):
        out[i] = max(out[i], np.nextafter(out[i - 1], np.inf))
    return out
