"""``numerics=`` under ``torch.compile``: a whole model compiled makes no graph break on either
path (the torch reductions, the fused kernels); of blocks compiled one by one (as torchtitan
does), the compiled modules' probes carry the output gradient's numerics with its norm and
NaN/Inf count, and write what an eager run writes and plain torch computes of the gradients, of a
module called twice in one forward too, without another graph or a graph break."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import Run, read_run
from torch import Tensor, nn
from torch._dynamo.utils import counters

from tblog_hooks import HookLogger
from tblog_hooks.kernels import VARIABLE

FORMATS = ("fp16", "e5m2")


class _Net(nn.Module):
    """``shared`` runs twice per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(6, 32), nn.Linear(32, 32), nn.Linear(32, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.shared(torch.tanh(self.shared(self.inp(x))))))


def _train(log_dir: Path, *, compiled: bool, numerics: object = FORMATS) -> tuple[Run, dict[str, list[Tensor]]]:
    """Two logged steps; each block compiled on its own with ``compiled``. Returns the run and,
    eagerly, every call's output gradient of each module by step, kept by a test tensor hook."""
    torch.manual_seed(0)
    model = _Net()
    data = torch.randn(2, 64, 6)
    # The loss's weights span 14 decades: so do the output gradients, past fp16's and e5m2's range.
    weights = torch.randn(2, 64, 3) * 10 ** (torch.rand(2, 64, 3) * 14 - 12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: dict[str, list[Tensor]] = {}
    with HookLogger(model, log_dir=log_dir, every=1, optimizer=opt, histograms=False, numerics=numerics) as hooks:
        names = list(hooks.module_names)
        for name in names:
            module = model.get_submodule(name)
            if compiled:
                module.compile(backend="aot_eager")
            else:
                module.register_forward_hook(_keeper(kept, name))
        for step, (x, w) in enumerate(zip(data, weights)):
            (model(x) * w).sum().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
            for name in names if not compiled else ():
                kept[f"{step}/{name}"] = kept.pop(name)
    return read_run(log_dir), kept


def _keeper(kept: dict[str, list[Tensor]], name: str):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, args: object, out: Tensor) -> None:
        out.register_hook(lambda g: kept.setdefault(name, []).append(g.detach().clone()))

    return hook


def _reference(calls: list[Tensor]) -> dict[str, float]:
    """Plain torch of a module's output gradients (one per call): amax, RMS and kurtosis of all
    of them; the fp16 fractions of casting each with ``x.to(torch.float16)``; e5m2's of casting
    each after scaling it by ``max / amax`` (per tensor, its own amax)."""
    d = torch.cat([g.double().reshape(-1) for g in calls])
    n = d.numel()
    m2, m4 = d.square().mean().item(), d.pow(4).mean().item()
    out = {"amax": d.abs().max().item(), "rms": math.sqrt(m2), "kurtosis": m4 / m2**2 - 3}
    out["zero_frac"] = int((d == 0).sum()) / n
    lost = {"underflow_fp16": 0, "overflow_fp16": 0, "subnormal_fp16": 0, "underflow_e5m2": 0, "overflow_e5m2": 0}
    fp16, e5m2 = torch.finfo(torch.float16), torch.finfo(torch.float8_e5m2)
    for g in calls:
        g = g.float()
        half = g.to(torch.float16).float()
        scaled = (g * (e5m2.max / g.abs().amax().clamp(min=1e-12))).to(torch.float8_e5m2).float()
        lost["underflow_fp16"] += int(((g != 0) & (half == 0)).sum())
        lost["overflow_fp16"] += int((~torch.isfinite(half)).sum())
        lost["subnormal_fp16"] += int(((half != 0) & (half.abs() < fp16.smallest_normal)).sum())
        lost["underflow_e5m2"] += int(((g != 0) & (scaled == 0)).sum())
        lost["overflow_e5m2"] += int((~torch.isfinite(scaled)).sum())
    return {**out, **{stat: count / n for stat, count in lost.items()}}


def test_compiled_blocks_write_the_output_gradients_numerics_of_eager_and_of_plain_torch(tmp_path: Path) -> None:
    eager, kept = _train(tmp_path / "eager", compiled=False)
    torch._dynamo.reset()
    counters.clear()
    _train(tmp_path / "plain", compiled=True, numerics=False)
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = _train(tmp_path / "compiled", compiled=True)
    assert counters["stats"]["unique_graphs"] == graphs  # the probes' numerics add no graph
    assert not counters["graph_break"]
    checked, lost = 0, []
    for key, calls in kept.items():
        step, name = key.split("/")
        want = _reference(calls)
        lost.append((want["underflow_fp16"], want["underflow_e5m2"]))
        for stat, value in want.items():
            tag = f"gradient/{stat}/{name}"
            if stat == "amax" and len(calls) > 1:
                # Autograd adds up a module's calls' summaries in its probe: a maximum does not add up.
                assert tag not in compiled.scalars or int(step) not in compiled.scalars[tag], tag
                assert eager.scalar(tag, int(step)) == pytest.approx(value, rel=1e-6)
                continue
            for run in (eager, compiled):
                assert run.scalar(tag, int(step)) == pytest.approx(value, rel=1e-5, abs=1e-9), (tag, step)
            checked += 1
    assert checked == 2 * (3 * len(want) - 1)
    assert all(0 < fp16 < 1 and e5m2 > 0 for fp16, e5m2 in lost)  # (the fractions are exercised)
    assert {t for t in eager.scalars if t.startswith("gradient/")} - set(compiled.scalars) == {"gradient/amax/shared"}


ROOT = Path(__file__).resolve().parents[1]
#: A 4-layer MLP, every module watched, compiled whole with ``aot_eager``, two logged steps with
#: every format's numerics; prints the graph breaks and the kernels' first-pass launches.
_COMPILED_MLP = """
import json, sys
import torch
from torch import nn
from torch._dynamo.utils import counters
from tblog_hooks import HookLogger

device = "cuda" if torch.cuda.is_available() else "cpu"
launches = []
if sys.argv[2] == "kernels":
    from tblog_hooks.kernels import fused
    launch = fused._partials.run
    fused._partials.run = lambda *args, **kwargs: launches.append(1) or launch(*args, **kwargs)
torch.manual_seed(0)
layers = [nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)]
model = nn.Sequential(*layers).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
numerics = ("fp16", "bf16", "e4m3", "e5m2")
with HookLogger(model, log_dir=sys.argv[1], every=1, modules="*", optimizer=opt, numerics=numerics) as hooks:
    compiled = torch.compile(model, backend="aot_eager")
    for x in torch.randn(2, 8, 16, device=device):
        compiled(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        hooks.step()
print(json.dumps({"graph_breaks": dict(counters["graph_break"]), "launches": len(launches)}))
"""


@pytest.mark.parametrize(
    "path",
    [
        "torch",
        pytest.param(
            "kernels",
            marks=pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not importable"),
        ),
    ],
)
def test_a_compiled_model_with_numerics_makes_no_graph_break_on_either_path(tmp_path: Path, path: str) -> None:
    """In a process of its own, as a training run is (nothing the numerics read was worked out
    before the first trace): no graph break (``torch._dynamo.utils.counters``) and every
    format's numerics written, on the torch path and on the kernels' (in Triton's interpreter
    without a GPU)."""
    kernels = {"torch": "torch", "kernels": "auto" if torch.cuda.is_available() else "triton"}[path]
    env = {**os.environ, VARIABLE: kernels}
    out = subprocess.run(
        [sys.executable, "-c", _COMPILED_MLP, str(tmp_path), path],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    said = json.loads(out.stdout.splitlines()[-1])
    assert said["graph_breaks"] == {}
    assert (said["launches"] > 0) == (path == "kernels")
    scalars = read_run(tmp_path).scalars
    for fmt in ("fp16", "bf16", "e4m3", "e5m2"):
        assert set(scalars[f"activation/underflow_{fmt}/2"]) == {0, 1}, fmt
        assert set(scalars[f"gradient/underflow_{fmt}/2"]) == {0, 1}, fmt


class _Transposed(nn.Module):
    """Returns a view whose strides are not contiguous (as ``nn.MultiheadAttention`` with
    ``batch_first=True`` returns its output)."""

    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(0, 1)


def _transposing(log_dir: Path, *, fullgraph: bool | None) -> Run:
    """Two logged steps of a model with a non-contiguous activation, compiled whole with
    ``fullgraph`` (``None``: eager)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), _Transposed(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=log_dir, every=1, modules="*", optimizer=opt, numerics=FORMATS) as hooks:
        run = model if fullgraph is None else torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
        for x in torch.randn(2, 4, 5, 6):
            run(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    return read_run(log_dir)


@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_compiled_non_contiguous_activation_gets_its_numerics_as_eager(tmp_path: Path, fullgraph: bool) -> None:
    """A non-contiguous output's numerics in compiled code: no ``out=`` into a buffer of its
    strides, which dynamo refuses (with ``fullgraph=True`` that stopped training at the first
    logged forward); what eager mode writes, no graph break."""
    eager = _transposing(tmp_path / "eager", fullgraph=None)
    torch._dynamo.reset()
    counters.clear()
    compiled = _transposing(tmp_path / "compiled", fullgraph=fullgraph)
    assert counters["graph_break"] == {}
    tags = [t for t in eager.scalars if t.startswith("activation/") and t.endswith("/1")]
    assert {"activation/underflow_fp16/1", "activation/underflow_e5m2/1"} <= set(tags)
    for tag in tags:
        assert compiled.scalars[tag] == pytest.approx(eager.scalars[tag], rel=1e-5), tag
