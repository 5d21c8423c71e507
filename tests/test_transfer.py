"""Logged steps whose device copy is still in flight are written later, in order, exactly once."""

from __future__ import annotations

import pytest
import torch
from conftest import read_run
from torch import nn

from tblog_hooks import HookLogger
from tblog_hooks.diagnostics import per_step as diagnose
from tblog_hooks.output import outbox
from tblog_hooks.transport import transfer


class SlowTransfer(transfer.Transfer):
    """A transfer that stays in flight until the test releases it, as an async CUDA copy can."""

    released = False

    def ready(self) -> bool:
        return SlowTransfer.released


def test_in_flight_steps_are_written_later_in_order_exactly_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(outbox, "Transfer", SlowTransfer)
    written: list[int] = []
    real_write = diagnose.Diagnostics.write

    def spy(self, writer, summary):  # type: ignore[no-untyped-def]
        written.append(summary.step)
        real_write(self, writer, summary)

    monkeypatch.setattr(diagnose.Diagnostics, "write", spy)
    model = nn.Sequential(nn.Linear(3, 3))
    means = []
    with HookLogger(model, log_dir=tmp_path, every=2) as hooks:
        for step in range(6):
            out = model(torch.full((2, 3), float(step)))
            means.append(float(out.detach().mean()))
            out.sum().backward()
            hooks.step()
            assert written == []  # nothing is ready, so step() never waits for a copy
        SlowTransfer.released = True
        model(torch.ones(2, 3)).sum().backward()
        hooks.step()  # step 6 is logged; everything ready so far is written now
        assert written == [0, 2, 4, 6]
        SlowTransfer.released = False
        model(torch.ones(2, 3)).sum().backward()
        hooks.step()
        model(torch.ones(2, 3)).sum().backward()  # step 8, logged, still in flight at close
    assert written == [0, 2, 4, 6, 8]  # close() waited for the last one
    run = read_run(tmp_path)
    assert sorted(run.scalars["activation/mean/0"]) == [0, 2, 4, 6, 8]
    for step in (0, 2, 4):
        assert run.scalar("activation/mean/0", step) == pytest.approx(means[step], rel=1e-6)
