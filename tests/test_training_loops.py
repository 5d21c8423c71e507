"""Training loops as users write them: evaluation passes, checkpointing, AMP, modules called more
than once a step, sparse gradients."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torchvision
from conftest import needs_cuda, read_run
from models import mlp
from torch import nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

from tblog_hooks import Histograms, HookLogger
from tblog_hooks.stats.tags import HISTOGRAM_KINDS as KINDS


def _scalars(log_dir, step: int = 0) -> dict[str, float]:
    return {tag: by_step[step] for tag, by_step in read_run(log_dir).scalars.items() if step in by_step}


def test_evaluation_passes_are_left_out_unless_asked_for(tmp_path) -> None:
    model = mlp(6, 16, 16, 3)
    x, x_eval = torch.randn(8, 6), torch.randn(32, 6) * 5
    for eval_passes in (False, True):
        with HookLogger(model, log_dir=tmp_path / str(eval_passes), every=1, eval_passes=eval_passes) as hooks:
            train_out = model[0](x).detach()  # hooks fire; this call is the reference
            model(x).sum().backward()
            with torch.no_grad():
                model(x_eval)
            model.eval()
            eval_out = model[0](x_eval).detach()
            model.train()
            hooks.step()
        hist = read_run(tmp_path / str(eval_passes)).histograms["activation/0"][0]
        mean = _scalars(tmp_path / str(eval_passes))["activation/mean/0"]
        if eval_passes:
            # the training pass (twice: by hand and in model(x)), the no_grad pass and the eval pass
            assert hist.num == 2 * train_out.numel() + x_eval.shape[0] * 16 + eval_out.numel()
        else:
            assert hist.num == 2 * train_out.numel()
            assert mean == pytest.approx(float(train_out.double().mean()), rel=1e-5)


def _single(model: nn.Sequential, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
    # the first two layers recomputed in backward; inputs need grad for use_reentrant=True
    return model[2:](checkpoint(model[:2], x.requires_grad_(reentrant), use_reentrant=reentrant))


def _nested(model: nn.Sequential, x: torch.Tensor, outer: bool, inner: bool) -> torch.Tensor:
    """Layers 0-3 in a checkpoint whose function checkpoints layers 1-2 again."""

    def region(h: torch.Tensor) -> torch.Tensor:
        return model[3](checkpoint(model[1:3], model[0](h), use_reentrant=inner))

    return model[4](checkpoint(region, x.requires_grad_(True), use_reentrant=outer))


_CHECKPOINTS = {
    "reentrant": lambda m, x: _single(m, x, True),
    "non-reentrant": lambda m, x: _single(m, x, False),
    **{
        f"nested-{a}-{b}": lambda m, x, a=a, b=b: _nested(m, x, a == "reentrant", b == "reentrant")
        for a in ("reentrant", "non-reentrant")
        for b in ("reentrant", "non-reentrant")
    },
    "sequential": lambda m, x: checkpoint_sequential(m, 2, x.requires_grad_(True), use_reentrant=True),
}


@pytest.mark.parametrize("how", list(_CHECKPOINTS))
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad")  # a nested reentrant first pass
def test_checkpoint_recompute_is_not_counted_twice(tmp_path, how: str) -> None:
    model = mlp(6, 16, 16, 3)
    x = torch.randn(8, 6)
    with HookLogger(model, log_dir=tmp_path / "plain", every=1) as hooks:
        model(x).square().sum().backward()
        hooks.step()
    plain = _scalars(tmp_path / "plain")
    model.zero_grad()
    with HookLogger(model, log_dir=tmp_path / "ckpt", every=1) as hooks:
        _CHECKPOINTS[how](model, x).square().sum().backward()
        hooks.step()
    checkpointed = _scalars(tmp_path / "ckpt")
    assert set(checkpointed) == set(plain)
    for tag, value in plain.items():
        assert checkpointed[tag] == pytest.approx(value, rel=1e-5, abs=1e-7), tag
    for name in ("0", "2"):
        assert read_run(tmp_path / "ckpt").histograms[f"activation/{name}"][0].num == 8 * 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_statistics_are_accumulated_in_float32(tmp_path, dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU())
    x = torch.randn(64, 64) + 3  # |mean| >> std and a large zero bucket after the ReLU
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["0", "1"]) as hooks:
        with torch.autocast("cpu", dtype=dtype):
            h = model[0](x)
            out = model[1](h)
        out.float().sum().backward()
        hooks.step()
    assert h.dtype == dtype
    full = model[0](x).detach().double()  # the fp32 reference
    run = read_run(tmp_path)
    for name, low, ref in (("0", h, full), ("1", out, full.relu())):
        exact = low.detach().double()
        for stat, value in (("mean", exact.mean()), ("std", exact.std()), ("max", exact.max())):
            logged = run.scalar(f"activation/{stat}/{name}", 0)
            assert logged == pytest.approx(float(value), rel=1e-5), (name, stat)  # accumulated in float32
        assert run.scalar(f"activation/mean/{name}", 0) == pytest.approx(float(ref.mean()), rel=1e-2)
        assert run.scalar(f"activation/std/{name}", 0) == pytest.approx(float(ref.std()), rel=2e-2)
    hist = run.histograms["activation/1"][0]
    assert int((out == 0).sum()) > 1000  # one bucket far beyond what 16-bit counts can hold exactly
    assert hist.num == out.numel() and sum(hist.bucket) == out.numel()


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("with_optimizer", [False, True])
@pytest.mark.parametrize("update_before_step", [True, False])
def test_grad_scaler_gradients_are_unscaled_and_skipped_steps_reported(
    tmp_path, device: str, with_optimizer: bool, update_before_step: bool
) -> None:
    model, reference = mlp(6, 16, 16, 3).to(device), mlp(6, 16, 16, 3).to(device)
    reference.load_state_dict(model.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    # The scale doubles after every good step, so each step uses a different one.
    scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=1)
    xs = [torch.randn(8, 6, device=device) for _ in range(3)]
    expected: dict[int, dict[str, float]] = {}
    optimizer = opt if with_optimizer else None
    # Every kind recorded here, the linear gradient histograms too.
    histograms = Histograms(every_logged=1, weights_every_logged=2, kinds=[k for k in KINDS if k != "input"])
    with HookLogger(
        model, log_dir=tmp_path, every=1, modules=["4"], scaler=scaler, optimizer=optimizer, histograms=histograms
    ) as hooks:
        for step, x in enumerate(xs):
            poison = math.inf if step == 1 else 1.0  # step 1 overflows: the scaler skips it
            scaler.scale(_loss(model(x)) * poison).backward()
            scaler.step(opt)
            if not update_before_step:
                hooks.step()
            scaler.update()
            opt.zero_grad()
            if update_before_step:
                hooks.step()
            if step != 1:
                out = reference(x)
                out.retain_grad()
                _loss(out).backward()
                expected[step] = {
                    "gradient/norm/4": float(out.grad.double().norm()),
                    "param_grad/norm/4.weight": float(reference[4].weight.grad.double().norm()),
                    "param_grad/norm/4.bias": float(reference[4].bias.grad.double().norm()),
                }
                ref_opt.step()
                ref_opt.zero_grad()
    for step in (0, 2):
        scalars = _scalars(tmp_path, step)
        assert scalars["amp/skipped_step"] == 0
        assert scalars["amp/loss_scale"] == 2.0**10  # step 0: the initial scale; step 2: backed off after 1
        for tag, value in expected[step].items():
            assert scalars[tag] == pytest.approx(value, rel=1e-5), (step, tag)
    skipped = _scalars(tmp_path, 1)
    assert skipped["amp/skipped_step"] == 1 and skipped["amp/loss_scale"] == 2.0**11
    assert skipped["gradient/nonfinite/4"] > 0  # where the overflow shows
    assert not any(t.startswith(("gradient/norm", "param_grad")) for t in skipped)
    hists = read_run(tmp_path).histograms
    assert 1 not in hists["gradient/4"]
    edges = np.asarray(hists["gradient/4"][0].bucket_limit)
    assert edges.max() <= expected[0]["gradient/norm/4"]  # edges unscaled too


def test_rnn_cell_called_every_time_step_pools_all_calls(tmp_path) -> None:
    cell = nn.RNNCell(5, 7)
    model = nn.ModuleDict({"cell": cell})
    xs = torch.randn(6, 3, 5)  # six time steps, batch of three
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["cell"]) as hooks:
        h = torch.zeros(3, 7)
        states = []
        for x in xs:
            h = cell(x, h)
            h.retain_grad()
            states.append(h)
        h.square().sum().backward()
        hooks.step()
    outputs = torch.stack([s.detach() for s in states]).double()
    grad_norm = float(torch.stack([s.grad for s in states]).double().norm())  # each call's output gradient
    scalars = _scalars(tmp_path)
    assert scalars["activation/mean/cell"] == pytest.approx(float(outputs.mean()), rel=1e-5)
    assert scalars["activation/std/cell"] == pytest.approx(float(outputs.std()), rel=1e-5)
    assert scalars["gradient/norm/cell"] == pytest.approx(grad_norm, rel=1e-5)
    assert read_run(tmp_path).histograms["activation/cell"][0].num == outputs.numel()


def test_resnet_reused_relu_pools_both_calls(tmp_path) -> None:
    model = torchvision.models.resnet18(num_classes=4)
    block = model.layer1[0]
    seen: list[torch.Tensor] = []
    block.relu.register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))  # reference
    with HookLogger(model, log_dir=tmp_path, every=1, modules=["layer1.0.relu"], gradients=False) as hooks:
        model(torch.randn(2, 3, 32, 32)).sum().backward()
        hooks.step()
    assert len(seen) == 2  # BasicBlock calls its one ReLU twice
    both = torch.cat([t.reshape(-1) for t in seen]).double()
    scalars = _scalars(tmp_path)
    assert scalars["activation/mean/layer1.0.relu"] == pytest.approx(float(both.mean()), rel=1e-5)
    assert scalars["activation/zero_frac/layer1.0.relu"] == pytest.approx(float((both == 0).double().mean()))
    assert read_run(tmp_path).histograms["activation/layer1.0.relu"][0].num == pytest.approx(both.numel())


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("with_optimizer", [False, True])
def test_sparse_gradients_are_logged_as_their_dense_values(tmp_path, device: str, with_optimizer: bool) -> None:
    model = nn.Sequential(nn.Embedding(50, 4, sparse=True), nn.Linear(4, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Repeated ids within and across two micro-batches: the accumulated .grad repeats indices.
    batches = [torch.tensor(ids, device=device) for ids in ([[3, 7, 3], [9, 3, 7]], [[7, 11, 3], [3, 3, 40]])]
    optimizer = opt if with_optimizer else None
    with HookLogger(model, log_dir=tmp_path, every=1, optimizer=optimizer) as hooks:
        for ids in batches:
            model(ids).square().mean().backward()
        grads = {name: p.grad.to_dense().double().cpu() for name, p in model.named_parameters()}
        opt.step()
        hooks.step()
    assert not model[0].weight.grad.is_coalesced()
    run = read_run(tmp_path)
    for name, grad in grads.items():
        assert run.scalar(f"param_grad/norm/{name}", 0) == pytest.approx(float(grad.norm()), rel=1e-5), name
    total = math.sqrt(sum(float(g.square().sum()) for g in grads.values()))
    assert run.scalar("param_grad/global_norm", 0) == pytest.approx(total, rel=1e-5)
    rows = grads["0.weight"][[3, 7, 9, 11, 40]]  # the rows looked up: the sparse gradient's values
    hist = run.histograms["param_grad/0.weight"][0]
    assert (hist.num, hist.min, hist.max) == (rows.numel(), pytest.approx(rows.min()), pytest.approx(rows.max()))
