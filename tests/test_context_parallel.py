"""Context parallelism (``torch.distributed.tensor.experimental.context_parallel``) on two CPU
processes with gloo, under FSDP2 over the same ranks as torchtitan shards its parameters: each
rank holds a shard of every sequence of the same batch, as plain tensors (attention, non-causal,
in the math backend: the CPU's). With ``reduce_ranks=True`` every scalar is the one a single
process with the whole batch gives (the shards pool as batch pieces do); histograms are the
writing rank's shard's, as under data parallelism its batch's."""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import assert_same_run, read_run, spawn_ranks
from models import Llama
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tblog_hooks import Histograms, HookLogger
from tblog_hooks.stats.binning import BINS

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")

STEPS = 2
OPTIONS: dict[str, object] = {
    "every": 1,
    "inputs": True,
    "histograms": Histograms(every_logged=1, weights_every_logged=1),
    "spikes": True,
    "attention": True,
}
#: One step's sequence shard: ``(tokens, labels, positions)`` -> the context it runs in.
Context = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], contextlib.AbstractContextManager[object]]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)


def _train(model: nn.Module, log_dir: str, context: Context, **options: object) -> list[torch.Tensor]:
    """``STEPS`` SGD steps of the mean cross-entropy; each step's positions (of this rank's shard)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    held = []
    with HookLogger(model, log_dir=log_dir, optimizer=opt, **{**OPTIONS, **options}) as hooks:  # type: ignore[arg-type]
        for step in range(STEPS):
            (tokens, labels), positions = _batch(step), torch.arange(8)
            with context(tokens, labels, positions), sdpa_kernel(SDPBackend.MATH):
                loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
                loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
            held.append(positions)
    return held


def _context_parallel(rank: int, root: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.experimental import context_parallel

    model, mesh = Llama(causal=False), init_device_mesh("cpu", (2,))
    freqs = model.freqs
    fully_shard(model, mesh=mesh)

    def shard(
        tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor
    ) -> contextlib.AbstractContextManager[None]:
        buffers = [tokens, labels, positions, freqs]
        return context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0, 0], no_restore_buffers={*buffers[:3]})

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        held = _train(model, f"{root}/cp", shard, reduce_ranks=True)
    if rank == 0:
        (Path(root) / "held.json").write_text(json.dumps([p.tolist() for p in held]))
        (warning,) = [str(w.message) for w in caught if "tblog_hooks" in str(w.message)]
        assert "'attention' failed" in warning and "context parallelism is active" in warning


def test_context_parallel_statistics_are_those_of_one_process(tmp_path: Path) -> None:
    spawn_ranks(_context_parallel, tmp_path, 2)
    model, outputs = Llama(causal=False), {}
    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, a, out, name=name: outputs.setdefault(name, []).append(out.detach()))
    _train(model, str(tmp_path / "one"), lambda *_: contextlib.nullcontext())
    run, one = read_run(tmp_path / "cp"), read_run(tmp_path / "one")
    roots = ("activation/", "gradient/", "input/", "param_grad/", "param/", "step/")
    assert_same_run(run, one, range(STEPS), roots, histograms=False)
    assert any(t.startswith("attention/") for t in one.scalars)
    assert not [t for t in run.scalars if t.startswith("attention/")]  # (said once: left out)
    # The writing rank's histograms: its shard's positions of every sequence, as plain torch has them.
    held = json.loads((tmp_path / "held.json").read_text())
    assert sorted(held[0]) != list(range(8))  # (a shard)
    for name, calls in outputs.items():
        tag = f"activation/{name}"
        if tag not in one.histograms:
            continue
        for step in range(STEPS):
            want, got = calls[step][:, held[step]].double().numpy(), run.histograms[tag][step]
            assert (got.num, got.min, got.max) == (want.size, pytest.approx(want.min()), pytest.approx(want.max())), tag
            # BINS buckets of [min, max], the maximum in the last (just short of BINS), empty ends trimmed
            at = np.floor((want - want.min()) / (want.max() - want.min()) * BINS * (1 - 2**-16)).astype(int)
            counts = np.bincount(at.reshape(-1), minlength=BINS)
            filled = np.flatnonzero(counts)
            assert list(got.bucket) == counts[filled[0] : filled[-1] + 1].tolist(), tag
