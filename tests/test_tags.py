"""Module names are user data: tags stay valid and unambiguous, and give the names back."""

from __future__ import annotations

import urllib.parse

import pytest
import torch
from conftest import read_run
from torch import nn

from tblog_hooks import HookLogger
from tblog_hooks.stats.tags import escape

# ModuleDict keys may hold anything but '.': '/', '%', spaces, unicode, control characters,
# lone surrogates; "mean/0" would make the histogram tag of one module the scalar tag of "0".
NAMES = ["0", "mean/0", "a/b c", "50%", "%2F", "слой 1", "层", "tab\there", "line\nbreak", "\udc80"]


def _decode(part: str) -> str:
    return urllib.parse.unquote(part, errors="surrogatepass")


def test_escape_round_trips_and_leaves_plain_names_alone() -> None:
    assert escape("layer1.0.conv2") == "layer1.0.conv2"
    assert escape("a/b c") == "a%2Fb c" and escape("50%") == "50%25" and escape("слой 1") == "слой 1"
    for name in NAMES:
        escaped = escape(name)
        assert "/" not in escaped and escaped.isprintable()
        assert _decode(escaped) == name


@pytest.mark.filterwarnings("error::RuntimeWarning")  # a name must never switch logging off
def test_user_data_names_round_trip_through_the_event_reader(tmp_path) -> None:
    model = nn.ModuleDict({name: nn.Linear(3, 2) for name in NAMES})
    x = torch.randn(5, 3)
    with HookLogger(model, log_dir=tmp_path, every=1, modules=[nn.Linear]) as hooks:
        outputs = {name: layer(x) for name, layer in model.items()}
        sum(out.sum() for out in outputs.values()).backward()
        hooks.step()
    run = read_run(tmp_path)

    decoded: dict[tuple[str, ...], str] = {}
    for tag in [*run.scalars, *run.histograms]:
        kind, *rest = tag.split("/")
        parts = (kind, *rest[:-1], _decode(rest[-1]))
        assert parts not in decoded, (tag, decoded.get(parts))  # unambiguous: one tag per meaning
        decoded[parts] = tag
    for name, out in outputs.items():
        assert run.scalar(decoded["activation", "mean", name], 0) == pytest.approx(float(out.detach().mean()), rel=1e-5)
        assert run.histograms[decoded["activation", name]][0].num == out.numel()
        assert ("param_grad", "norm", f"{name}.weight") in decoded
    assert ("param_grad", "global_norm") in {parts[:2] for parts in decoded}
    # The scalar tags of module "0" and the histogram tag of module "mean/0" stay apart.
    assert run.scalar("activation/mean/0", 0) == pytest.approx(float(outputs["0"].detach().mean()), rel=1e-5)
    assert "activation/mean%2F0" in run.histograms
