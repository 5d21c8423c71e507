"""``modules=``: names, globs, types, predicates and module instances, exact names before globs,
unknown names, and the names the logger prints."""

from __future__ import annotations

import pytest
import torch
from conftest import read_run
from models import conv_net
from torch import nn

from tblog_hooks import HookLogger, HookLoggerError
from tblog_hooks.capture.selection import select_modules


def _glob_named() -> nn.ModuleDict:
    return nn.ModuleDict({name: nn.Linear(2, 2) for name in ("head[0]", "head0", "x*", "xy")})


@pytest.mark.parametrize(
    ("selectors", "names"),
    [
        ("head[0]", ["head[0]"]),  # an exact name, not the class [0] (which matches head0)
        ("x*", ["x*"]),  # an exact name, not the glob (which matches xy too)
        ("head[!x]", ["head0"]),  # no such name: a glob
        ("x?", ["x*", "xy"]),
        (["head[0]", "head0"], ["head[0]", "head0"]),
    ],
)
def test_an_exact_name_selects_that_module_before_globbing(selectors: object, names: list[str]) -> None:
    assert list(select_modules(_glob_named(), selectors)) == names  # type: ignore[arg-type]


def test_select_by_name_glob_type_predicate_or_module_and_lists_of_them(tmp_path) -> None:
    model = conv_net(classes=2, batch_norm=True, lazy=True)
    model(torch.randn(1, 3, 8, 8))  # shapes the LazyLinear head
    cases = {
        "0.0": ("0.0",),
        "1.*": ("1.0", "1.1", "1.2"),
        nn.Conv2d: ("0.0", "1.0"),
        (lambda name, m: isinstance(m, nn.ReLU)): ("0.1", "1.2"),
    }
    for selector, names in cases.items():
        with HookLogger(model, log_dir=tmp_path / "names", modules=selector) as hooks:
            assert hooks.module_names == names
    with HookLogger(model, log_dir=tmp_path / "names") as hooks:  # default: the modules owning parameters
        assert hooks.module_names == ("0.0", "1.0", "1.1", "3")
    with HookLogger(model, log_dir=tmp_path / "names", modules=["1.*", nn.Conv2d]) as hooks:
        assert hooks.module_names == ("0.0", "1.0", "1.1", "1.2")

    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    assert select_modules(model, model[2][0]) == {"2.0": model[2][0]}
    assert select_modules(model, [model[0], "1", model]) == {"root": model, "0": model[0], "1": model[1]}
    assert select_modules(model, model[2]) == {"2": model[2]}  # a container is one module, not its children
    with HookLogger(model, log_dir=tmp_path / "module", modules=model[0], every=1) as hooks:
        model(torch.randn(5, 3)).sum().backward()
        hooks.step()
    assert hooks.module_names == ("0",)
    assert set(read_run(tmp_path / "module").scalars["gradient/norm/0"]) == {0}


def test_unknown_names_are_one_error_listing_close_matches(tmp_path) -> None:
    model = conv_net(classes=2, batch_norm=True, lazy=True)
    with pytest.raises(HookLoggerError) as info:
        HookLogger(model, log_dir=tmp_path, modules=["1.O", "layer*", nn.LSTM, "0.0"])
    message = str(info.value)
    assert "'1.O'" in message and "1.0" in message  # closest existing name offered
    assert "'layer*'" in message and "LSTM" in message
    assert "'0.0'" not in message  # only the selectors that matched nothing
    assert not list(tmp_path.iterdir())  # nothing written for a logger that never started


def _titan_block() -> nn.Module:
    """A block named as torchtitan 0.3.0's Llama 3 blocks are (``qkv_linear.wqkv``, no ``wq``)."""
    attention = nn.ModuleDict({"qkv_linear": nn.ModuleDict({"wqkv": nn.Linear(2, 6)}), "wo": nn.Linear(2, 2)})
    return nn.ModuleDict(
        {"attention": attention, "feed_forward": nn.ModuleDict({f"w{i}": nn.Linear(2, 2) for i in (1, 2, 3)})}
    )


def test_the_closest_names_offer_a_like_last_part_first(tmp_path) -> None:
    with pytest.raises(HookLoggerError) as info:
        HookLogger(
            nn.ModuleDict({"layers": nn.ModuleList([_titan_block(), _titan_block()])}),
            log_dir=tmp_path,
            modules=["layers.0.attention.wq"],
        )
    assert "(closest names: layers.0.attention.qkv_linear.wqkv, layers.1.attention.qkv_linear.wqkv, " in str(info.value)
    assert "layers.0.attention.wo" in str(info.value)  # (the whole names' closest follow)


def test_a_module_outside_the_model_is_an_error_naming_it() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    with pytest.raises(HookLoggerError, match="a Linear that is not part of the model"):
        select_modules(model, [model[0], nn.Linear(3, 4)])


def test_names_the_logger_prints_are_accepted_back(tmp_path) -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    with HookLogger(model, log_dir=tmp_path / "a", modules=["", "*"]) as first:
        assert first.module_names == ("root", "0", "1")
    with HookLogger(model, log_dir=tmp_path / "b", modules=list(first.module_names)) as second:
        assert second.module_names == first.module_names
    assert select_modules(model, "root") == {"root": model}
    # A submodule named "root" is that submodule (the model is then selected as ""), and the two
    # cannot both be watched: they would share the name.
    named_root = nn.ModuleDict({"root": nn.Linear(2, 2)})
    assert select_modules(named_root, "root") == {"root": named_root["root"]}
    with pytest.raises(HookLoggerError) as info:
        HookLogger(named_root, log_dir=tmp_path / "c", modules=["", "root"])
    assert "both the model itself (shown as 'root') and its submodule named 'root'" in str(info.value)
    with HookLogger(named_root, log_dir=tmp_path / "c", modules="root") as hooks:
        assert hooks.module_names == ("root",)
