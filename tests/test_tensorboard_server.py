"""A real TensorBoard server serves, through its HTTP data API, exactly what the logger wrote."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import read_run, tensorboard
from torch import nn

from tblog_hooks import HookLogger

RUN = "net"
READY_WITHIN_S = 90  # how long to wait for the server to load the run before giving up


def _get(url: str, path: str, **query: str) -> object:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(query)}", timeout=10) as response:
        return json.load(response)


def _wait_for_tags(url: str, plugin: str, tags: set[str], log: Path) -> None:
    """Poll until the server answers and has loaded ``tags`` of the run (it loads asynchronously)."""
    deadline = time.monotonic() + READY_WITHIN_S
    while time.monotonic() < deadline:
        try:
            served = _get(url, f"/data/plugin/{plugin}/tags")
            if tags <= set(served.get(RUN, {})):  # type: ignore[union-attr]
                return
        except (urllib.error.URLError, ConnectionError):
            pass  # not listening yet
        time.sleep(0.25)
    pytest.fail(f"tensorboard did not serve {plugin} tags {sorted(tags)}; its log:\n{log.read_text()}")


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="stops the server's process group (POSIX)")
def test_tensorboard_serves_what_the_logger_wrote(tmp_path) -> None:
    model = nn.Sequential()
    model.add_module("a/b c", nn.Linear(6, 5))  # a name that must be escaped in tags and URLs
    model.add_module("act", nn.Tanh())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected_mean: dict[int, float] = {}
    expected_numel = 0
    with HookLogger(model, log_dir=tmp_path / "logs" / RUN, every=2, modules=["a/b c"], histograms=1) as hooks:
        for step in range(5):
            out = model[0](torch.randn(7, 6))
            if step % 2 == 0:
                expected_mean[step] = float(out.detach().double().mean())
                expected_numel = out.numel()
            model[1](out).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    written = read_run(tmp_path / "logs" / RUN)
    mean_tag, hist_tag = "activation/mean/a%2Fb c", "activation/a%2Fb c"

    with tensorboard(tmp_path / "logs") as url:
        _wait_for_tags(url, "scalars", set(written.scalars), tmp_path / "tensorboard.log")
        _wait_for_tags(url, "histograms", set(written.histograms), tmp_path / "tensorboard.log")
        served_scalars = {
            tag: {step: value for _, step, value in _get(url, "/data/plugin/scalars/scalars", run=RUN, tag=tag)}  # type: ignore[union-attr]
            for tag in written.scalars
        }
        served_hist = _get(url, "/data/plugin/histograms/histograms", run=RUN, tag=hist_tag)

    assert served_scalars == written.scalars  # every scalar, every step, bit for bit
    for step, mean in expected_mean.items():
        assert served_scalars[mean_tag][step] == pytest.approx(mean, rel=1e-5)
    assert [step for _, step, _ in served_hist] == [0, 2, 4]  # type: ignore[misc, union-attr]
    for _, step, buckets in served_hist:  # type: ignore[misc, union-attr]
        hist = written.histograms[hist_tag][step]
        lefts, rights, counts = zip(*buckets)
        assert list(counts) == list(hist.bucket) and sum(counts) == expected_numel
        assert list(rights) == pytest.approx(list(hist.bucket_limit))
        assert lefts[0] == pytest.approx(hist.min) and list(lefts[1:]) == pytest.approx(rights[:-1])
