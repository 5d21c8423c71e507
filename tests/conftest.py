"""Shared helpers: read a run back with TensorBoard's own reader."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing import event_accumulator


@dataclass
class Run:
    scalars: dict[str, dict[int, float]]
    histograms: dict[str, dict[int, object]]  # HistogramValue with min, max, num, bucket_limit, bucket

    def scalar(self, tag: str, step: int) -> float:
        return self.scalars[tag][step]


def read_run(log_dir: str | Path) -> Run:
    acc = event_accumulator.EventAccumulator(
        str(log_dir), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.HISTOGRAMS: 0}
    )
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: {e.step: e.value for e in acc.Scalars(t)} for t in tags["scalars"]}
    histograms = {t: {e.step: e.histogram_value for e in acc.Histograms(t)} for t in tags["histograms"]}
    return Run(scalars, histograms)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
