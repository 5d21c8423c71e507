"""A fixed set of small seeded runs whose event files are a reference: every scalar, histogram,
tensor (findings, value tables), image and the custom-scalars layout, read back with
TensorBoard's ``EventAccumulator``, as JSON.

    python scripts/golden.py record tests/golden.json   # on the code whose output is the reference
    python scripts/golden.py compare tests/golden.json  # exit 1, naming what differs

``tests/test_golden.py`` runs the comparison, so a refactor that keeps every tag, figure and
finding keeps it green. Both run in a process of their own whose numbers are the same on every
x86-64 machine (:data:`REPRODUCIBLE`): a float32 training's last bits follow the CPU's vector
width, and a few steps make them every figure's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from google.protobuf import json_format
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.util import tensor_util
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import models

from tblog_hooks import HookLogger, Spikes
from tblog_hooks.cli.demo import run_demo

LAYOUT_TAG = "custom_scalars__config__"
#: Relative tolerance of a float's comparison (exact up to float rounding).
REL = 1e-9
#: The environment in which :func:`main` records: ATen's unvectorised kernels (its AVX2 and
#: AVX-512 ones sum in other orders), MKL's code path that is the same on every x86-64 CPU, one
#: thread (a reduction is split by the thread count). Read when torch starts, so set for a
#: process of its own; oneDNN, whose kernels follow the CPU too, is switched off while recording.
REPRODUCIBLE = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def _demo(scenario: str, steps: int, every: int) -> Callable[[Path], Path]:
    def run(root: Path) -> Path:
        return run_demo(root, scenario, steps, every, torch.device("cpu"))

    return run


def _numerics(root: Path) -> Path:
    """An MLP under a CPU ``GradScaler`` whose first step overflows, with inputs and every format."""
    torch.manual_seed(0)
    model = models.mlp(8, 16, 16, 4, act=nn.ReLU, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    numerics = ("fp16", "bf16", "e4m3", "e5m2")
    with HookLogger(
        model, log_dir=root, every=2, optimizer=opt, scaler=scaler, inputs=True, numerics=numerics
    ) as hooks:
        for _ in range(8):
            x = torch.randn(32, 8)
            scaler.scale(model(x).square().mean()).backward()
            models.optimizer_step(opt, scaler)
            hooks.step()
    return root


def _conv(root: Path) -> Path:
    """A conv net with feature maps and numerics on its training format."""
    torch.manual_seed(0)
    model = models.conv_net(batch_norm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with HookLogger(model, log_dir=root, every=2, optimizer=opt, feature_maps=["0.0"], numerics=True) as hooks:
        for _ in range(4):
            loss = nn.functional.cross_entropy(model(torch.randn(8, 3, 8, 8)), torch.randint(0, 3, (8,)))
            loss.backward()
            models.optimizer_step(opt)
            hooks.step()
    return root


def _attention(root: Path) -> Path:
    torch.manual_seed(0)
    model = models.Llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HookLogger(model, log_dir=root, every=1, optimizer=opt, attention=True) as hooks:
        for _ in range(3):
            tokens = torch.randint(0, 32, (2, 8))
            loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
            loss.backward()
            models.optimizer_step(opt)
            hooks.step()
    return root


def _spikes(root: Path) -> Path:
    """A gradient spike between logged steps."""
    torch.manual_seed(0)
    model = models.mlp(16, 32, 32, 4, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with HookLogger(model, log_dir=root, every=25, optimizer=opt, spikes=Spikes(warmup=10)) as hooks:
        for step in range(60):
            x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
            if step == 40:
                x = x * 100.0
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            models.optimizer_step(opt)
            hooks.step(loss=loss)
    return root


RUNS: dict[str, Callable[[Path], Path]] = {
    "vanishing": _demo("vanishing", 12, 3),
    "exploding": _demo("exploding", 30, 5),
    "dead-relu": _demo("dead-relu", 12, 3),
    "nan": _demo("nan", 40, 5),
    "numerics": _numerics,
    "conv": _conv,
    "attention": _attention,
    "spikes": _spikes,
}


def _number(x: float) -> float | str:
    return x if math.isfinite(x) else repr(x)


def _tensor(tag: str, proto: object) -> object:
    if tag == LAYOUT_TAG:
        return json_format.MessageToDict(layout_pb2.Layout.FromString(proto.string_val[0]))  # type: ignore[attr-defined]
    a = tensor_util.make_ndarray(proto)
    if a.dtype.kind in "SO":
        return [s.decode() if isinstance(s, bytes) else str(s) for s in a.reshape(-1)]
    return [_number(float(v)) for v in np.asarray(a, dtype=np.float64).reshape(-1)]


def read(run: Path) -> dict[str, object]:
    """Everything TensorBoard reads of a run, by kind and tag, then by step."""
    acc = event_accumulator.EventAccumulator(
        str(run), size_guidance={event_accumulator.IMAGES: 0, event_accumulator.TENSORS: 0, "histograms": 0}
    )
    acc.Reload()
    tags = acc.Tags()
    out: dict[str, dict[str, dict[str, object]]] = {"scalars": {}, "histograms": {}, "tensors": {}, "images": {}}
    for t in tags["scalars"]:
        out["scalars"][t] = {str(e.step): _number(e.value) for e in acc.Scalars(t)}
    for t in tags["histograms"]:
        out["histograms"][t] = {
            str(e.step): [
                _number(v)
                for v in (
                    e.histogram_value.min,
                    e.histogram_value.max,
                    e.histogram_value.num,
                    e.histogram_value.sum,
                    e.histogram_value.sum_squares,
                    *e.histogram_value.bucket_limit,
                    *e.histogram_value.bucket,
                )
            ]
            for e in acc.Histograms(t)
        }
    for t in tags["tensors"]:
        out["tensors"][t] = {str(e.step): _tensor(t, e.tensor_proto) for e in acc.Tensors(t)}
    for t in tags["images"]:
        out["images"][t] = {str(e.step): hashlib.sha256(e.encoded_image_string).hexdigest() for e in acc.Images(t)}
    return out


def record_all() -> dict[str, object]:
    """Every run, read back (one thread, without oneDNN; the thread count is put back after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.backends.mkldnn.flags(enabled=False), tempfile.TemporaryDirectory() as tmp:
            return {name: read(run(Path(tmp) / name)) for name, run in RUNS.items()}
    finally:
        torch.set_num_threads(threads)


def differences(expected: object, got: object, where: str = "") -> list[str]:
    """What differs between two readings (floats to :data:`REL`), as paths."""
    if isinstance(expected, dict) and isinstance(got, dict):
        out = [f"{where}/{k}: missing" for k in expected if k not in got]
        out += [f"{where}/{k}: new" for k in got if k not in expected]
        for k in expected.keys() & got.keys():
            out += differences(expected[k], got[k], f"{where}/{k}")
        return out
    if isinstance(expected, list) and isinstance(got, list):
        if len(expected) != len(got):
            return [f"{where}: {len(expected)} values, now {len(got)}"]
        return [d for i, (a, b) in enumerate(zip(expected, got)) for d in differences(a, b, f"{where}[{i}]")]
    if isinstance(expected, float) and isinstance(got, float):
        return [] if math.isclose(expected, got, rel_tol=REL, abs_tol=1e-300) else [f"{where}: {expected} != {got}"]
    return [] if expected == got else [f"{where}: {expected!r} != {got!r}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("path", type=Path)
    args = parser.parse_args()
    if any(os.environ.get(name) != value for name, value in REPRODUCIBLE.items()):
        return subprocess.run([sys.executable, *sys.argv], env={**os.environ, **REPRODUCIBLE}).returncode
    got = record_all()
    if args.action == "record":
        args.path.write_text(json.dumps(got, sort_keys=True, separators=(",", ":")))
        return 0
    diff = differences(json.loads(args.path.read_text()), json.loads(json.dumps(got)))
    for line in diff[:50]:
        print(line)
    print(f"{len(diff)} difference(s)")
    return 1 if diff else 0


if __name__ == "__main__":
    raise SystemExit(main())
