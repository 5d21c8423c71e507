"""The options as a user meets them: values checked (a switch is a bool, "off" is ``False`` or
``None`` alike), errors that name the argument given, renamed keywords that keep working with a
``DeprecationWarning``, one name per idea, and signatures that ``help()``, editors and mypy see."""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
import uuid
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from conftest import read_tags
from torch import nn

from tblog_hooks import Histograms, HookLogger, HookLoggerError, Spikes, Thresholds
from tblog_hooks.diagnostics.findings import FINDING_KINDS
from tblog_hooks.options import NAMES, Options, WatchOptions


def _model() -> nn.Sequential:
    return nn.Sequential(OrderedDict(encoder=nn.Linear(4, 8), act=nn.ReLU(), decoder=nn.Linear(8, 2)))


def _error(call: object, *args: object, **kwargs: object) -> str:
    with pytest.raises(HookLoggerError) as info:
        call(*args, **kwargs)  # type: ignore[operator]
    return str(info.value)


# -- 7: values checked, one spelling of "off" ----------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [("activations", "no"), ("reduce_ranks", "yes"), ("eval_passes", 1), ("inputs", None), ("gradients", 0)],
)
def test_a_switch_takes_only_true_or_false(tmp_path, option: str, value: object) -> None:
    message = _error(HookLogger, _model(), log_dir=tmp_path, **{option: value})
    assert f"{option} must be True or False, got {value!r}" in message


def _train_one_logged_step(log_dir: Path, **options: object) -> dict[str, list[str]]:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=log_dir, every=1, optimizer=opt, **options) as hooks:  # type: ignore[arg-type]
        model(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        hooks.step()
    return read_tags(log_dir)


#: Each watch switched off as the options were first written to be (the reference spelling).
_OFF = {
    "histograms": False,
    "feature_maps": None,
    "attention": False,
    "health": None,
    "spikes": False,
    "numerics": False,
}


@pytest.mark.parametrize("off", [False, None])
def test_off_is_false_or_none_for_every_watch(tmp_path, off: object) -> None:
    reference = _train_one_logged_step(tmp_path / "reference", **_OFF)
    assert reference["histograms"] == []
    assert not [t for t in reference["scalars"] if t.split("/")[0] in ("attention", "step") or "/amax/" in t]
    assert _train_one_logged_step(tmp_path / "all", **dict.fromkeys(_OFF, off)) == reference
    for option in _OFF:  # and each alone
        assert _train_one_logged_step(tmp_path / option, **{**_OFF, option: off}) == reference, option
    config = Options(**dict.fromkeys(_OFF, off))  # type: ignore[arg-type]
    assert (config.histogram_schedule, config.thresholds, config.spike_config, config.numerics_formats) == (None,) * 4


def test_health_true_is_the_default_thresholds() -> None:
    assert Options(health=True).thresholds == Thresholds()
    message = _error(Options, health="on")
    assert "health must be a tblog_hooks.Thresholds" in message and "False or None" in message and "'on'" in message


# -- 8 and 10: renamed keywords keep working for a release ----------------------------------------


def test_old_histogram_keywords_warn_and_mean_what_they_meant() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        old = Histograms(every=3, param_every=2)
    messages = [str(w.message) for w in caught]
    assert any("Histograms(every=...) is deprecated" in m and "use every_logged=" in m for m in messages)
    assert any("use weights_every_logged=" in m and "every_logged * param_every" in m for m in messages)
    assert {w.filename for w in caught} == {__file__}  # pointed at the caller's line
    assert old == Histograms(every_logged=3, weights_every_logged=6)
    # The old meaning: histograms on every `every`-th logged step, weights on every `param_every`-th of those.
    for i in range(40):
        expected = set() if i % 3 else set(old.kinds) - ({"param"} if i % 6 else set())
        assert old.kinds_at(i) == expected
    with pytest.warns(DeprecationWarning, match="every_logged"):
        assert Histograms(every=4).every == 4  # (read under its old name too)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("fp16_underflow", "fp16_gradient_underflow"),
        ("massive_value", "massive_activation"),
        ("skipped_steps", "amp_skipped_steps"),
    ],
)
def test_old_threshold_names_warn_naming_the_finding_kind(old: str, new: str) -> None:
    assert new in FINDING_KINDS
    with pytest.warns(DeprecationWarning, match=rf"Thresholds\({old}=\.\.\.\) is deprecated.*use {new}="):
        thresholds = Thresholds(**{old: 7})
    assert thresholds == Thresholds(**{new: 7})
    with pytest.warns(DeprecationWarning, match=rf"Thresholds\.{old} is deprecated.*Thresholds\.{new}"):
        assert getattr(thresholds, old) == 7
    assert f"got both {old}= and {new}=" in _error(Thresholds, **{old: 7, new: 7})


def test_threshold_fields_are_named_after_the_kinds_they_tune() -> None:
    first_words = {kind.split("_")[0] for kind in FINDING_KINDS}
    for field in dataclasses.fields(Thresholds):
        shared = field.name in ("growth_window", "zero_steps")
        assert shared or field.name in FINDING_KINDS or field.name.split("_")[0] in first_words, field.name


def test_new_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Histograms(every_logged=2, weights_every_logged=4)
        Thresholds(fp16_gradient_underflow=0.1, massive_activation=50, amp_skipped_steps=5)
        Options(histograms=Histograms(), health=Thresholds())


@pytest.mark.parametrize(
    ("call", "keyword", "close"),
    [
        (Histograms, "evry_logged", "every_logged"),
        (Thresholds, "dead_frac", "dead_fraction"),
        (Spikes, "windw", "window"),
    ],
)
def test_an_unknown_keyword_is_a_hook_logger_error_with_the_closest(call: object, keyword: str, close: str) -> None:
    message = _error(call, **{keyword: 1})
    assert f"got unknown keyword(s) {keyword!r} (did you mean {close!r}?)" in message


def test_histogram_kinds_are_singular_tag_roots_and_the_plural_is_pointed_out() -> None:
    message = _error(Histograms, kinds=("activations", "inputs"))
    assert "'activations' (did you mean 'activation'?)" in message and "'inputs' (did you mean 'input'?)" in message
    assert "(singular, as the tags are: activation/{module}; unlike the options activations=" in message


def test_spike_counts_say_their_unit() -> None:
    assert "a whole number of optimizer steps >= 3" in _error(Spikes, window=2)
    assert "a whole number of logged steps" in _error(Thresholds, growth_window=0)


# -- 9: each error names the argument the user gave -----------------------------------------------


def test_selector_errors_name_the_option_they_were_given_as(tmp_path) -> None:
    for option in ("attention", "feature_maps"):
        message = _error(HookLogger, _model(), log_dir=tmp_path, **{option: "nope*"})
        assert message.startswith(f"{option}= has selectors that match no module"), message
        assert "modules=" not in message.split("\n")[0]
    assert _error(HookLogger, _model(), log_dir=tmp_path, attention=[3]).startswith("attention= got 3")


def test_spikes_window_alone_does_not_blame_a_warmup_never_given() -> None:
    message = _error(Spikes, window=5)
    assert message.startswith("Spikes(window=5) is smaller than the default warmup=20"), message
    assert "pass window >= 20, or warmup <= 5" in message
    message = _error(Spikes, warmup=200)
    assert message.startswith("Spikes(warmup=200) is larger than the default window=128"), message
    assert _error(Spikes, window=40, warmup=50).startswith("Spikes(warmup=50) is larger than window=40:")


def test_an_unwritable_default_directory_is_not_called_log_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("a file where SummaryWriter() makes its directory")
    message = _error(HookLogger, _model())
    assert message.startswith("SummaryWriter()'s default directory (no log_dir= given) must be a directory"), message


# -- 13: the constructors' signatures are the options ---------------------------------------------


def _keyword_only(call: object) -> dict[str, inspect.Parameter]:
    parameters = inspect.signature(call).parameters  # type: ignore[arg-type]
    return {n: p for n, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_hook_logger_signature_lists_every_option_with_its_default() -> None:
    parameters = inspect.signature(HookLogger).parameters
    assert next(iter(parameters)) == "model"
    options = _keyword_only(HookLogger)
    assert tuple(options) == NAMES
    assert len(parameters) == len(NAMES) + 1  # no **options left over
    for field in dataclasses.fields(Options):
        shown = options[field.name].default
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        assert repr(shown) == (repr(default) if field.name != "health" else "Thresholds()"), field.name
        assert options[field.name].annotation == field.type
    assert "every: 'int' = 100" in str(inspect.signature(HookLogger))


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_callback_signatures_list_the_options_the_framework_does_not_supply(framework: str) -> None:
    module = pytest.importorskip(f"tblog_hooks.integrations.{framework}")
    options = _keyword_only(module.HookLoggerCallback)
    assert tuple(options) == tuple(f.name for f in dataclasses.fields(WatchOptions))
    assert set(NAMES) - set(options) == {"writer", "log_dir", "optimizer", "scaler", "start_step"}
    assert "log_every_n_steps" in repr(options["every"].default) or "logging_steps" in repr(options["every"].default)


def test_callbacks_check_values_at_construction() -> None:
    module = pytest.importorskip("tblog_hooks.integrations.lightning")
    assert "activations must be True or False" in _error(module.HookLoggerCallback, activations="no")
    assert "HookLoggerCallback got unknown option(s) 'evry'" in _error(module.HookLoggerCallback, evry=3)


def test_mypy_sees_a_misspelt_option(tmp_path) -> None:
    source = tmp_path / f"typo_{uuid.uuid4().hex}.py"  # a module name the cache holds no entry for
    source.write_text(
        "from torch import nn\nfrom tblog_hooks import HookLogger\n"
        "HookLogger(nn.Linear(2, 2), evry=3)\nHookLogger(nn.Linear(2, 2), every='3')\n"
        "HookLogger(nn.Linear(2, 2), every=3, health=None, attention=None, histograms=None, feature_maps=False)\n"
    )
    root = Path(__file__).parents[1]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--follow-imports=silent",
            "--cache-dir",
            str(root / ".mypy_cache"),
            str(source),
        ],
        capture_output=True,
        text=True,
        cwd=root,
        check=False,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith(str(source)) and ": error:" in line]
    assert len(lines) == 2, result.stdout
    assert 'Unexpected keyword argument "evry" for "HookLogger"; did you mean "every"?' in lines[0]
    assert 'Argument "every" to "HookLogger" has incompatible type "str"; expected "int"' in lines[1]
