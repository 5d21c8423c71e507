"""Large models: a run's bytes stay bounded per watched module, histograms are written on the
logged steps their cadence names (and sampled on no others), and bad ``histograms=`` values
are clear errors at construction."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import read_run
from models import train
from torch import nn
from torch.nn import functional as F

from tblog_hooks import Histograms, HookLogger, HookLoggerError
from tblog_hooks.stats import sampling
from tblog_hooks.stats.tags import HISTOGRAM_KINDS as KINDS

#: The target with the defaults, every=1, 10 logged steps (README "Large models"): bytes of the
#: event files per watched module per logged step.
BYTES_PER_MODULE_STEP = 3_000


class _Block(nn.Module):
    """A GPT-2 block's modules and names (``attn.c_attn``, ``mlp.c_fc``, ...), in plain torch."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(width, 3 * width), "c_proj": nn.Linear(width, width)})
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(width, 4 * width), "c_proj": nn.Linear(4 * width, width)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.attn["c_attn"](self.ln_1(x)).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4)
        x = x + self.attn["c_proj"](F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x))))


class _GPT(nn.Module):
    def __init__(self, layers: int, width: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.h = nn.Sequential(*(_Block(width) for _ in range(layers)))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(self.h(self.wte(tokens))))


def _next_token_losses(model: _GPT, steps: int) -> Iterator[torch.Tensor]:
    """Each step's loss: every token of a fresh batch of two sequences predicted from those before it."""
    for _ in range(steps):
        tokens = torch.randint(0, 128, (2, 16))
        yield F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def _logged_run(model: _GPT, log_dir: Path, steps: int, **options: object) -> HookLogger:
    """``steps`` steps of AdamW with a logger of ``options``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HookLogger(model, log_dir=log_dir, **options) as hooks:  # type: ignore[arg-type]
        train(hooks, _next_token_losses(model, steps), opt)
    return hooks


def test_event_bytes_per_module_and_logged_step_stay_under_the_target(tmp_path) -> None:
    hooks = _logged_run(_GPT(layers=12), tmp_path / "defaults", steps=10, every=1)
    modules = len(hooks.module_names)
    assert modules == 12 * 6 + 3
    written = sum(p.stat().st_size for p in (tmp_path / "defaults").iterdir())
    assert written / modules / 10 <= BYTES_PER_MODULE_STEP
    # The same run with a histogram of every kind on every logged step is well over it: the
    # bound is what the defaults choose, not what any run costs.
    _logged_run(
        _GPT(layers=12),
        tmp_path / "all",
        steps=10,
        every=1,
        histograms=Histograms(1, 1, [k for k in KINDS if k != "input"]),
    )
    everything = sum(p.stat().st_size for p in (tmp_path / "all").iterdir())
    assert everything / modules / 10 > BYTES_PER_MODULE_STEP


def _histogram_steps(log_dir: Path) -> dict[str, set[int]]:
    """The steps holding histograms of each kind (tag root), over all modules."""
    out: dict[str, set[int]] = {}
    for tag, by_step in read_run(log_dir).histograms.items():
        out.setdefault(tag.split("/")[0], set()).update(by_step)
    return out


@pytest.mark.parametrize(
    ("histograms", "expected"),
    [
        # logged steps 0, 3, ..., 27 are logged-step numbers 0..9
        (True, {"activation": {0, 15}, "gradient_log10": {0, 15}, "param_grad": {0, 15}, "param": {0}}),
        (2, {"activation": {0, 6, 12, 18, 24}, "param": {0, 12, 24}}),
        (
            Histograms(every_logged=3, weights_every_logged=3, kinds=[k for k in KINDS if k != "input"]),
            {kind: {0, 9, 18, 27} for kind in KINDS} | {"input": set()},
        ),
        (Histograms(every_logged=1, weights_every_logged=4, kinds=["param"]), {"param": {0, 12, 24}}),
        (False, {}),
    ],
)
def test_histograms_are_written_on_exactly_the_steps_of_their_cadence(tmp_path, histograms, expected) -> None:
    _logged_run(_GPT(layers=1), tmp_path, steps=28, every=3, histograms=histograms)
    found = _histogram_steps(tmp_path)
    for kind, steps in expected.items():
        assert found.get(kind, set()) == steps, kind
    if histograms is True or histograms == 2:
        assert "gradient" not in found  # the linear output-gradient histogram is opt-in
        assert found.keys() == {"activation", "gradient_log10", "param_grad", "param"}
    if histograms is False:
        assert not found
    # Scalars are written on every logged step whatever the histograms.
    assert set(read_run(tmp_path).scalars["gradient/norm/h.0.mlp.c_fc"]) == set(range(0, 28, 3))


def test_steps_without_histograms_take_no_samples(tmp_path, monkeypatch) -> None:
    model = _GPT(layers=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    hooks = HookLogger(model, log_dir=tmp_path, every=1, histograms=3)
    calls: Counter[int] = Counter()
    sample = sampling.sample

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls[hooks.global_step] += 1
        return sample(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampling, "sample", spy)
    with hooks:
        for _ in range(7):
            tokens = torch.randint(0, 128, (2, 8))
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    assert set(calls) == {0, 3, 6}  # activations, output gradients, parameter gradients and weights
    assert calls[0] > calls[3] > 0  # step 3 takes no weights (weights_every_logged=6)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, r"histograms must be True \(the defaults, Histograms\(\)\), False or None \(none\), a positive int n .* 0"),
        (-5, "got -5"),
        (2.5, "got 2.5"),
        ("5", "got '5'"),
        ("off", "got 'off'"),
    ],
)
def test_bad_histograms_values_are_clear_errors_and_attach_nothing(tmp_path, value, message) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(HookLoggerError, match=message):
        HookLogger(model, log_dir=tmp_path, histograms=value)
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"every_logged": 0}, r"Histograms\(every_logged=0\) is invalid: it must be a positive int"),
        ({"weights_every_logged": True}, r"Histograms\(weights_every_logged=True\) is invalid"),
        ({"every_logged": 1.5}, r"Histograms\(every_logged=1.5\)"),
        ({"kinds": ["activation", "weights"]}, r"holds 'weights'; kinds are tag roots among activation, input, grad"),
        ({"kinds": ()}, r"is empty \(pass histograms=False for none\)"),
        ({"kinds": 3}, "holds 3"),
    ],
)
def test_bad_histograms_settings_are_clear_errors(options, message) -> None:
    with pytest.raises(HookLoggerError, match=message):
        Histograms(**options)


def test_histograms_settings_are_normalised() -> None:
    assert Histograms(kinds={"param", "activation"}).kinds == ("activation", "param")  # in KINDS order
    assert Histograms(kinds="gradient").kinds == ("gradient",)
    assert Histograms().kinds == ("activation", "input", "gradient_log10", "param_grad", "param")
