"""The torch versions the package claims: a compiled model on a torch older than the compiled hooks
are tested on is logged with a warning saying so (``docs/index.md``: supported versions)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from tblog_hooks import HookLogger
from tblog_hooks.capture import step


@pytest.mark.parametrize(("version", "warned"), [((2, 6), True), (step.COMPILE_VERIFIED, False)])
def test_a_compiled_model_on_an_older_torch_is_logged_with_a_warning(tmp_path, monkeypatch, version, warned) -> None:
    monkeypatch.setattr(step, "TORCH_VERSION", version)
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    with warnings.catch_warnings(record=True) as caught, HookLogger(model, log_dir=tmp_path, every=1) as hooks:
        warnings.simplefilter("always")
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(2):
            compiled(torch.randn(3, 4)).sum().backward()
            hooks.step()
    said = [w for w in caught if "verified on torch >= 2.14" in str(w.message)]
    assert len(said) == (1 if warned else 0)  # once per logger
