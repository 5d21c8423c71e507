"""Property tests: device statistics, histograms and the host-side merge against NumPy references,
on random tensors with NaN, Inf, subnormals, extremes and float16/bfloat16/float32/float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes

from tblog_hooks import Histograms
from tblog_hooks.capture.activations import ActivationRecorder
from tblog_hooks.capture.step import StepBuffer
from tblog_hooks.output.summarize import summarize
from tblog_hooks.stats import binning, reductions, sampling
from tblog_hooks.stats.packing import pack_step
from tblog_hooks.stats.recipe import Recipe, Source
from tblog_hooks.topology.parallel import TensorParallel

SETTINGS = settings(max_examples=100, deadline=None, database=None)
NONFINITE = st.sampled_from([math.nan, math.inf, -math.inf])
# Float32 and wider accumulation keeps mean and std finite and accurate within these magnitudes
# (the sum of squares of n values must stay below the accumulation type's maximum).
BOUNDS = {torch.float16: 65504.0, torch.bfloat16: 1e15, torch.float32: 1e15, torch.float64: 1e150}
# Histogram edges stay finite over the whole float16/bfloat16/float32 range; float64 to +-8e307.
EXTREME = {torch.float16: 65504.0, torch.bfloat16: 3.38e38, torch.float32: 3.4e38, torch.float64: 8e307}
DTYPES = st.sampled_from(sorted(BOUNDS, key=str))


@st.composite
def tensors(draw: st.DrawFn, *, extreme: bool = False) -> torch.Tensor:
    """A tensor of 0 to 3 dims; values within the accurate range, or anywhere in the dtype's range."""
    dtype = draw(DTYPES)
    bound = (EXTREME if extreme else BOUNDS)[dtype]
    shape = draw(array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=7))
    finite = st.floats(-bound, bound, width=16 if dtype == torch.float16 else 64)
    special = st.sampled_from([0.0, -0.0, 1e-40, -5e-324, bound, -bound])
    values = draw(st.lists(st.one_of(finite, special, NONFINITE), min_size=math.prod(shape), max_size=math.prod(shape)))
    return torch.tensor(values, dtype=torch.float64).reshape(shape).to(dtype)


#: The recipe of a logger of the default options.
RECIPE = Recipe.build()


def _reference(x: torch.Tensor) -> np.ndarray:
    return x.double().numpy()  # the tensor's own (rounded) values, in float64


def _tolerance(a: np.ndarray, dtype: torch.dtype) -> float:
    """Rounding bound of a float32 (or float64) accumulation over ``a``; squares of values
    below sqrt(tiny) (~1e-19 in float32) underflow, so norms that small may read as 0."""
    info = np.finfo(np.float64 if dtype == torch.float64 else np.float32)
    return 4 * a.size * float(info.eps) * float(np.abs(a).max(initial=0.0)) + 2 * a.size * math.sqrt(info.tiny)


def _tensor_stats(x: torch.Tensor, units: int = 1) -> list[np.ndarray]:
    kind = RECIPE[Source.OUTPUT]
    return [t.double().numpy() for t in kind.values(kind.compute(x, units))]


@SETTINGS
@given(tensors())
def test_tensor_stats(x: torch.Tensor) -> None:
    mean, centred_norm, lo, hi, nonzero, finite, peak = _tensor_stats(x)
    a = _reference(x)
    assert nonzero == np.count_nonzero(a) and finite == np.count_nonzero(np.isfinite(a))
    if a.ndim >= 2:
        np.testing.assert_array_equal(peak, a.max(axis=tuple(d for d in range(a.ndim) if d != 1)))
    else:
        assert peak.size == 0
    np.testing.assert_array_equal([lo, hi], [a.min(), a.max()])  # NaN propagates
    if np.isfinite(a).all():
        tol = _tolerance(a, x.dtype)
        assert abs(mean - a.mean()) <= tol
        assert abs(centred_norm - np.linalg.norm(a - a.mean())) <= tol * 4
    else:
        assert not np.isfinite(mean)


@SETTINGS
@given(tensors(extreme=True))
def test_tensor_stats_counts_and_extremes_are_exact_anywhere_in_range(x: torch.Tensor) -> None:
    _, _, lo, hi, nonzero, finite, _ = _tensor_stats(x)
    a = _reference(x)
    assert nonzero == np.count_nonzero(a)
    assert finite == np.count_nonzero(np.isfinite(a))
    np.testing.assert_array_equal([lo, hi], [a.min(), a.max()])


@SETTINGS
@given(tensors())
def test_gradient_stats(g: torch.Tensor) -> None:
    named = RECIPE[Source.OUTPUT_GRADIENT].compute(g, -1)
    norm, nonfinite = float(named["norm"]), float(named["nonfinite"])
    a = _reference(g)
    assert nonfinite == np.count_nonzero(~np.isfinite(a))
    expected = np.linalg.norm(a.reshape(-1))
    if np.isnan(a).any():
        assert math.isnan(norm)
    elif np.isinf(a).any():
        assert norm == math.inf
    else:
        assert abs(norm - expected) <= 4 * _tolerance(a, g.dtype) + 1e-6 * expected


def _check_histogram_row(row: np.ndarray, a: np.ndarray, weight: float) -> None:
    start, half_span, lo, hi = row[[binning.H_START, binning.H_HALF_SPAN, binning.H_MIN, binning.H_MAX]]
    span = 2 * half_span
    counts = row[binning.HIST_WIDTH - binning.BINS :]
    finite = a[np.isfinite(a)]
    assert math.isfinite(start) and math.isfinite(span) and span > 0  # bucket edges are always finite
    assert counts.sum() == pytest.approx(weight * finite.size, rel=1e-12)
    if finite.size == 0:
        assert (lo, hi) == (math.inf, -math.inf)
        return
    assert (lo, hi) == (finite.min(), finite.max())
    # Bucket b holds [start + span*b/BINS, start + span*(b+1)/BINS); the top edge is in the last bucket.
    # np.float64 arithmetic: elements within rounding of an edge may land in either neighbour.
    position = (finite / 2 - start / 2) / (span / 2) * binning.BINS  # halves: no overflow near the range ends
    expected = np.bincount(np.clip(np.floor(position), 0, binning.BINS - 1).astype(int), minlength=binning.BINS)
    near_edge = np.count_nonzero(np.abs(position - np.round(position)) < 1e-3)
    assert np.abs(counts / weight - expected).sum() <= 2 * near_edge
    assert start <= lo and hi <= start + span * (1 + 1e-6)


@SETTINGS
@given(st.lists(tensors(extreme=True), min_size=1, max_size=4), st.booleans())
def test_histograms(xs: list[torch.Tensor], exact: bool) -> None:
    """Rows over the exact extremes of each tensor (its NaN/Inf left to the sample's), or over
    the sample's own extremes."""
    samples = [sampling.sample(x, sampling.IndexCache()) for x in xs]
    extremes = [torch.aminmax(x) if exact else (None, None) for x in xs]
    lows, highs = [lo for lo, _ in extremes], [hi for _, hi in extremes]
    rows = binning.bin_rows(samples, lows, highs, list(range(len(xs)))).numpy()  # weights apply on the host
    assert rows.shape == (len(xs), binning.HIST_WIDTH)
    for row, s in zip(rows, samples):
        _check_histogram_row(row, _reference(s), 1.0)


def test_samples_of_large_tensors_are_spread_over_every_position() -> None:
    """A stride would alias with the layout (every 512th element of a [16, 64, 32, 32] map is in
    column 0); the sample covers every column, row and channel about equally."""
    x = torch.arange(16 * 64 * 32 * 32, dtype=torch.float64).reshape(16, 64, 32, 32)
    index = sampling.sample(x, sampling.IndexCache()).long().numpy()
    assert index.size == sampling.SAMPLE_CAP and np.unique(index).size > 0.99 * sampling.SAMPLE_CAP
    for size, stride in ((32, 1), (32, 32), (64, 1024), (16, 65536)):  # columns, rows, channels, batch
        per_position = np.bincount(index // stride % size, minlength=size)
        expected = sampling.SAMPLE_CAP / size
        assert np.all(np.abs(per_position - expected) < 5 * math.sqrt(expected)), (size, per_position)


@SETTINGS
@given(st.lists(tensors(), min_size=1, max_size=4))
def test_pooled_calls_match_the_concatenation(parts: list[torch.Tensor]) -> None:
    """Several calls of one module in a step (packed by pack_step, merged by summarize)."""
    buffer = StepBuffer(Histograms(), RECIPE)
    recorder = ActivationRecorder(
        buffer,
        None,
        activations=True,
        inputs=False,
        eval_passes=False,
        feature_maps=frozenset(),
        parallel=TensorParallel(torch.nn.Identity()),
    )
    buffer.begin(0)  # the first logged step: it takes histograms
    for x in parts:
        recorder.on_output("m", torch.nn.Identity(), (x,), x)
    packed, layout = pack_step(*buffer.drain(), buffer.kinds, buffer.indices, RECIPE)  # type: ignore[misc]
    summary = summarize(0, packed.numpy(), layout)
    a = np.concatenate([_reference(x).reshape(-1) for x in parts])
    scalars = summary.scalars
    assert scalars["activation/nonfinite/m"] == np.count_nonzero(~np.isfinite(a))
    assert scalars["activation/zero_frac/m"] == (a.size - np.count_nonzero(a)) / a.size
    np.testing.assert_array_equal([scalars["activation/min/m"], scalars["activation/max/m"]], [a.min(), a.max()])
    if np.isfinite(a).all():
        tol = max(_tolerance(_reference(x), x.dtype) for x in parts)
        assert abs(scalars["activation/mean/m"] - a.mean()) <= tol
        std = a.std(ddof=1) if a.size > 1 else 0.0
        assert abs(scalars["activation/std/m"] - std) <= 4 * tol + 1e-6 * std
    finite = np.isfinite(a)
    if finite.any():
        histogram = summary.histograms["activation/m"]
        assert histogram.num == finite.sum() and (histogram.min, histogram.max) == (a[finite].min(), a[finite].max())
        assert np.all(np.diff(histogram.limits) > 0) and np.all(np.isfinite(histogram.limits))
    else:
        assert "activation/m" not in summary.histograms


def test_finite_count_is_exact_past_float32_integers() -> None:
    """Beyond 2**24 elements a float32 sum of ones skips odd integers: the count sums in float64."""
    x = torch.zeros(2**24 + 3)
    x[[5, -1]] = torch.tensor([math.nan, -math.inf])
    assert float(reductions.finite(x)) == 2**24 + 1
    assert float(reductions.nonfinite(x)) == 2
