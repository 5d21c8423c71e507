"""What a failure switches off is a typed part or one module, never both: a watched module named
like a part keeps its statistics when that part fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import read_run
from torch import nn

from tblog_hooks import HookLogger
from tblog_hooks.capture import attention


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 5, 8)


def test_a_module_named_like_a_part_keeps_logging_when_that_part_fails(tmp_path: Path, monkeypatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("attention capture broke")

    monkeypatch.setattr(attention, "attention_statistics", broken)
    model = nn.Sequential()
    model.add_module("attention", Block())
    with (
        pytest.warns(RuntimeWarning, match="logging for 'attention' failed"),
        HookLogger(model, log_dir=tmp_path, every=1, modules=["attention"], attention=True) as hooks,
    ):
        for _ in range(3):
            model(torch.randn(2, 5, 8)).sum().backward()
            hooks.step()
    run = read_run(tmp_path)
    assert sorted(run.scalars["activation/mean/attention"]) == [0, 1, 2]
    assert not any(t.startswith("attention/") for t in run.scalars)
