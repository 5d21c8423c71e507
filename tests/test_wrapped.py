"""Wrappers anywhere in the tree, as torchtitan applies them to each block: ``checkpoint_wrapper``,
``torch.compile`` (an ``OptimizedModule``) and FSDP1-style ``_fsdp_wrapped_module``. Tags and
selectors use the names ``state_dict()`` gives (the user's), and the numbers are those of the
plain model; hooks a compiled block's code already ran without are refused at construction."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import Run, assert_same_run, read_run
from models import Llama
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from tblog_hooks import Histograms, HookLogger, HookLoggerError

ROOTS = ("activation/", "input/", "gradient/", "param_grad/", "param/")
WRAPPED = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")


def _train(model: nn.Module, log_dir: Path, modules: list[str] | None = None) -> Run:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    options = {"every": 1, "inputs": True, "histograms": Histograms(every_logged=1, weights_every_logged=1)}
    with HookLogger(model, log_dir=log_dir, optimizer=opt, modules=modules or ["*"], **options) as hooks:  # type: ignore[arg-type]
        for step in range(2):
            tokens = torch.randint(32, (2, 8), generator=torch.Generator().manual_seed(step))
            model(tokens).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    return read_run(log_dir)


def _blocks_wrapped(wrap: object) -> Llama:
    model = Llama()
    for key, block in model.layers.items():
        model.layers[key] = wrap(block)  # type: ignore[operator]
    return model


class _Fsdp1Style(nn.Module):
    """A wrapper holding its module as FSDP1's ``FullyShardedDataParallel`` does."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._fsdp_wrapped_module = module

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self._fsdp_wrapped_module(*args)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    "wrap",
    [
        checkpoint_wrapper,
        lambda block: torch.compile(block, backend="eager"),  # (compiled before its first forward)
        lambda block: _Fsdp1Style(checkpoint_wrapper(block)),
    ],
    ids=["checkpoint_wrapper", "compile", "fsdp1_and_checkpoint"],
)
def test_wrapped_blocks_log_what_the_plain_model_logs_under_its_names(tmp_path: Path, wrap: object) -> None:
    torch._dynamo.reset()  # (code compiled for the block's class by another test would ignore the hooks)
    plain, wrapped = _train(Llama(), tmp_path / "plain"), _train(_blocks_wrapped(wrap), tmp_path / "wrapped")
    assert not [t for t in [*wrapped.scalars, *wrapped.histograms] if any(w in t for w in WRAPPED)]
    assert_same_run(wrapped, plain, range(2), ROOTS)


def test_selectors_take_the_names_with_or_without_the_wrappers(tmp_path: Path) -> None:
    model = _blocks_wrapped(checkpoint_wrapper)
    names = ["layers.0.attention.wq", "layers.1._checkpoint_wrapped_module.attention.wk", "layers.*.ffn_norm"]
    with HookLogger(model, log_dir=tmp_path, modules=names) as hooks:  # (in model order)
        assert hooks.module_names == (
            "layers.0.ffn_norm",
            "layers.0.attention.wq",
            "layers.1.ffn_norm",
            "layers.1.attention.wk",
        )
    with HookLogger(model, log_dir=tmp_path, modules=["layers.0"]) as hooks:  # the block, not also its wrapper
        assert hooks.module_names == ("layers.0",)
    with pytest.raises(HookLoggerError, match=r"closest names: layers\.0\.attention\.wq(,|$)"):
        HookLogger(model, log_dir=tmp_path, modules=["layers.0.attention.wqq"])


def test_watching_inside_a_compiled_block_that_already_ran_is_refused(tmp_path: Path) -> None:
    torch._dynamo.reset()
    model = _blocks_wrapped(lambda block: torch.compile(block, backend="eager"))
    model(torch.randint(32, (2, 8)))  # its compiled code now ignores hooks added later
    with pytest.raises(HookLoggerError, match=r"'layers\.0' is compiled .* already ran.*create the HookLogger before"):
        HookLogger(model, log_dir=tmp_path, modules=["layers.0.attention.wq"])
    with HookLogger(model, log_dir=tmp_path, modules=["tok_embeddings", "head"]) as hooks:  # outside: eager
        assert hooks.module_names == ("tok_embeddings", "head")
