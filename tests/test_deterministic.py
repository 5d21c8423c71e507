"""Under ``torch.use_deterministic_algorithms(True)`` (Lightning's ``deterministic=True``, the HF
Trainer's ``full_determinism``) a logged step uses no kernel that mode refuses on CUDA, and a
failure to bin the histograms costs the histograms, never the scalars."""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from conftest import OpCounter, Run, read_run
from models import mlp, train
from torch import nn

from tblog_hooks import Histograms, HookLogger
from tblog_hooks.stats import binning
from tblog_hooks.stats.tags import HISTOGRAM_KINDS

STEPS = 3
#: Every histogram kind on every logged step.
EVERY_HISTOGRAM = Histograms(every_logged=1, weights_every_logged=1, kinds=list(HISTOGRAM_KINDS))
#: Ops ``torch.use_deterministic_algorithms`` documents as raising on CUDA tensors (torch 2.14),
#: by aten name: ``histc``, ``put_``, ``bincount`` with weights, ``median`` with indices,
#: ``scatter_reduce`` with ``prod``; the ones a logger's statistics could plausibly reach.
REFUSED_ON_CUDA = {"aten.histc", "aten.put_", "aten.put", "aten.bincount", "aten.median", "aten.nanmedian"}


@contextmanager
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def _histc_as_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.histc`` raising under deterministic mode, as ``_histc_cuda`` does."""
    original = torch.histc

    def histc(*args: object, **kwargs: object) -> torch.Tensor:
        if torch.are_deterministic_algorithms_enabled():
            raise RuntimeError("_histc_cuda does not have a deterministic implementation")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "histc", histc)


def _run(log_dir: object) -> tuple[Run, list[str]]:
    model = mlp(6, 16, 16, 3, act=nn.ReLU, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, 8, 6, generator=data)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with HookLogger(model, log_dir=log_dir, every=1, inputs=True, histograms=EVERY_HISTOGRAM) as hooks:
            train(hooks, (model(x[i]).square().mean() for i in range(STEPS)), opt)
    return read_run(log_dir), [str(w.message) for w in caught if str(w.message).startswith("tblog_hooks")]


def test_deterministic_mode_logs_every_scalar_and_histogram(tmp_path, monkeypatch) -> None:
    reference, _ = _run(tmp_path / "default")
    _histc_as_on_cuda(monkeypatch)
    with deterministic():
        run, messages = _run(tmp_path / "deterministic")
    assert messages == []
    assert set(run.scalars) == set(reference.scalars)
    for tag, by_step in reference.scalars.items():
        assert run.scalars[tag] == pytest.approx(by_step, nan_ok=True), tag
    assert set(run.histograms) == set(reference.histograms)
    assert {tag.split("/")[0] for tag in run.histograms} == set(HISTOGRAM_KINDS)
    for tag, by_step in reference.histograms.items():
        for step, want in by_step.items():
            got = run.histograms[tag][step]
            assert (got.min, got.max, got.num) == (want.min, want.max, want.num), (tag, step)
            assert list(got.bucket) == list(want.bucket) and list(got.bucket_limit) == list(want.bucket_limit)


def test_a_deterministic_logged_step_calls_no_op_refused_on_cuda(tmp_path) -> None:
    model = mlp(6, 16, 3, act=nn.ReLU, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = OpCounter()
    options = {"every": 1, "inputs": True, "histograms": EVERY_HISTOGRAM}
    with deterministic(), HookLogger(model, log_dir=tmp_path, **options) as hooks, counter:
        train(hooks, [model(torch.randn(8, 6)).square().mean()], opt)
    assert {"aten.sort", "aten.searchsorted"} <= set(counter.ops)  # the histograms were binned here
    assert not REFUSED_ON_CUDA & set(counter.ops)


def _rows(deterministic_mode: bool) -> np.ndarray:
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(n, generator=gen) * scale for n, scale in ((1000, 1.0), (7, 1e30), (50, 1e-40), (300, 3.0))]
    xs[0][:10] = math.nan
    xs[3][:5] = math.inf
    xs += [torch.full((5,), 2.5), torch.full((4,), math.nan), torch.tensor([-3e38, 3e38, 0.0])]
    lows = [None, xs[1].min(), None, None, None, None, None]
    highs = [None, xs[1].max(), None, None, None, None, None]
    keys = [0, 1, 2, 0, 3, 4, 5]  # rows 0 and 3: calls of one module, binned over one range
    if deterministic_mode:
        with deterministic():
            return binning.bin_rows(xs, lows, highs, keys).numpy()
    return binning.bin_rows(xs, lows, highs, keys).numpy()


def test_deterministic_counts_are_those_of_histc() -> None:
    rows = _rows(deterministic_mode=True)
    np.testing.assert_array_equal(rows, _rows(deterministic_mode=False))
    assert rows[:, binning.HIST_WIDTH - binning.BINS :].sum() == 990 + 7 + 50 + 295 + 5 + 0 + 3


def test_a_binning_failure_costs_the_histograms_only(tmp_path, monkeypatch) -> None:
    reference, _ = _run(tmp_path / "reference")
    calls = []

    def broken(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise RuntimeError("injected fault in binning")

    monkeypatch.setattr(binning, "bin_rows", broken)
    run, messages = _run(tmp_path / "broken")
    assert len(messages) == 1
    assert "logging for 'histograms' failed and is switched off" in messages[0] and "injected fault" in messages[0]
    assert calls == [1]  # the later steps take no histogram sample
    assert run.histograms == {}
    assert set(run.scalars) == set(reference.scalars)
    for tag, by_step in reference.scalars.items():
        assert run.scalars[tag] == pytest.approx(by_step, nan_ok=True), tag
