"""A logger attached before ``torch.compile`` keeps logging, with two graphs and no graph break."""

from __future__ import annotations

import pytest
import torch
from conftest import read_run
from torch import nn
from torch._dynamo.utils import counters

from tblog_hooks import HookLogger, HookLoggerError


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])  # inductor builds C++ kernels: ~20 s here
def test_logger_attached_before_compile_keeps_logging(tmp_path, backend: str) -> None:
    torch._dynamo.reset()
    counters.clear()
    model, reference = _mlp(), _mlp()
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    tags = ("activation/mean/0", "activation/max/2", "param_grad/norm/0.weight")
    expected: dict[str, dict[int, float]] = {tag: {} for tag in tags}
    with HookLogger(model, log_dir=tmp_path, every=2, optimizer=opt) as hooks:
        compiled = torch.compile(model, backend=backend)
        for step in range(5):
            x = torch.randn(8, 6)
            compiled(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
            h = reference[0](x)
            out = reference[2](reference[1](h))
            out.square().mean().backward()
            expected["activation/mean/0"][step] = float(h.detach().double().mean())
            expected["activation/max/2"][step] = float(out.detach().max())
            expected["param_grad/norm/0.weight"][step] = float(reference[0].weight.grad.double().norm())
            ref_opt.step()
            ref_opt.zero_grad()
    # One graph for logged steps with histograms (step 0), one for those without (2, 4), one for the
    # others: no recompilation per step, no graph break.
    assert counters["stats"]["unique_graphs"] == 3
    assert not counters["graph_break"]
    run = read_run(tmp_path)
    for tag, by_step in expected.items():
        assert set(run.scalars[tag]) == {0, 2, 4}
        for step in (0, 2, 4):
            assert run.scalar(tag, step) == pytest.approx(by_step[step], rel=1e-4, abs=1e-6), (tag, step)
    assert not any(tag.startswith("gradient/") for tag in run.scalars)  # not recorded when compiled


def test_attaching_to_a_compiled_model_is_a_clear_error(tmp_path) -> None:
    model = _mlp()
    with pytest.raises(HookLoggerError, match="create the HookLogger first"):
        HookLogger(torch.compile(model, backend="aot_eager"), log_dir=tmp_path)
    model.compile(backend="aot_eager")
    with pytest.raises(HookLoggerError, match="already compiled"):
        HookLogger(model, log_dir=tmp_path)
    assert not list(tmp_path.iterdir())
