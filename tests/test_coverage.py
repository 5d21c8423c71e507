"""What the logger covers: ``param_grad/global_norm`` (and ``spikes=``'s per-step norm) is the whole
model's, as ``clip_grad_norm_`` computes it; the default selection watches every module that owns
parameters, children or not; a watched module whose hooks never run is said once."""

from __future__ import annotations

import datetime
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import read_run, spawn_ranks
from models import mlp
from torch import Tensor, nn
from torch.nn import functional as F

from tblog_hooks import HookLogger

CLIP = 0.25


class WordTransformer(nn.Transformer):
    """The word language model's ``TransformerModel`` (pytorch/examples): ``nn.Transformer``'s
    encoder under an embedding, its decoder replaced by a Linear; (sequence, batch) inputs."""

    def __init__(self, tokens: int = 20, width: int = 16) -> None:
        super().__init__(d_model=width, nhead=2, dim_feedforward=32, num_encoder_layers=2, dropout=0.0)
        self.input_emb = nn.Embedding(tokens, width)
        self.decoder = nn.Linear(width, tokens)  # type: ignore[assignment]
        self.width = width

    def forward(self, src: Tensor) -> Tensor:  # type: ignore[override]
        mask = self.generate_square_subsequent_mask(len(src))
        h = self.encoder(self.input_emb(src) * math.sqrt(self.width), mask=mask)
        return F.log_softmax(self.decoder(h), dim=-1)


def _total(params: list[nn.Parameter]) -> float:
    """The L2 norm of every gradient, in float64, computed here."""
    return float(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params if p.grad is not None])))


@pytest.mark.parametrize("with_optimizer", [True, False])
def test_the_global_norm_of_a_transformer_is_clip_grad_norms_total(tmp_path, with_optimizer: bool) -> None:
    """AdamW after ``clip_grad_norm_(0.25)``: read where the optimizer steps, the global norm is that
    of the clipped gradients AdamW applies (0.25); read as backward ends (no ``optimizer=``), it is
    the total ``clip_grad_norm_`` returns. Both count ``nn.MultiheadAttention``'s own
    ``in_proj_weight`` and ``in_proj_bias``, which have tags of their own."""
    torch.manual_seed(0)
    model = WordTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    expected, steps = {}, {}
    given = {"optimizer": opt, "spikes": True} if with_optimizer else {}
    with warnings.catch_warnings(), HookLogger(model, log_dir=tmp_path, every=2, **given) as hooks:  # type: ignore[arg-type]
        warnings.simplefilter("ignore")  # (out_proj's hooks never run: test_a_module_used_functionally_...)
        for step in range(5):
            src, target = torch.randint(0, 20, (7, 3)), torch.randint(0, 20, (7, 3))
            loss = F.nll_loss(model(src).flatten(0, 1), target.flatten())
            loss.backward()
            total = float(nn.utils.clip_grad_norm_(model.parameters(), CLIP))
            assert total > CLIP  # (clipped: the two readings differ)
            expected[step] = _total(params) if with_optimizer else total
            steps[step] = _total(params)
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss if with_optimizer else None)
    run = read_run(tmp_path)
    assert run.scalars["param_grad/global_norm"] == pytest.approx({s: expected[s] for s in (0, 2, 4)}, rel=1e-5)
    if with_optimizer:
        assert run.scalars["param_grad/global_norm"] == pytest.approx({0: CLIP, 2: CLIP, 4: CLIP}, rel=1e-5)
        assert run.scalars["step/grad_norm"] == pytest.approx(steps, rel=1e-5)
    attention = model.encoder.layers[0].self_attn
    for name in ("in_proj_weight", "in_proj_bias"):
        own = f"param_grad/norm/encoder.layers.0.self_attn.{name}"
        assert set(run.scalars[own]) == {0, 2, 4}
    assert "activation/mean/encoder.layers.0.self_attn" in run.scalars  # (called as a module)
    assert attention.in_proj_weight.grad is None  # (zeroed: read in the step, not after)


def test_the_global_norm_counts_the_parameters_outside_the_watched_modules(tmp_path) -> None:
    """``modules=`` picks the tags, not what the global norm adds up: the parameters of the
    unwatched layers count in it and in ``step/grad_norm``, with no tag of their own."""
    model = mlp(6, 16, 16, 3, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = {}
    with HookLogger(model, log_dir=tmp_path, every=1, modules="2", optimizer=opt, spikes=True) as hooks:
        for step in range(3):
            loss = model(torch.randn(8, 6)).square().mean()
            loss.backward()
            expected[step] = _total(list(model.parameters()))
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)
    run = read_run(tmp_path)
    assert run.scalars["param_grad/global_norm"] == pytest.approx(expected, rel=1e-5)
    assert run.scalars["step/grad_norm"] == pytest.approx(expected, rel=1e-5)
    assert {t for t in run.scalars if t.startswith("param_grad/norm/")} == {
        "param_grad/norm/2.weight",
        "param_grad/norm/2.bias",
    }
    assert {t for t in run.scalars if t.startswith("param/update_ratio/")} == {
        "param/update_ratio/2.weight",
        "param/update_ratio/2.bias",
    }


def _train_watching_one_layer(model: nn.Module, log_dir: str, rank: int, world: int) -> None:
    """Three SGD steps on rank ``rank``'s share of a batch of four, watching layer ``2`` only."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with HookLogger(model, log_dir=log_dir, every=1, modules="2", optimizer=opt, spikes=True) as hooks:
        for step in range(3):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step)).chunk(world)[rank]
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step(loss=loss)


def _fsdp2_ranks(rank: int, root: str) -> None:
    from torch.distributed.fsdp import fully_shard

    model = mlp(6, 16, 16, 3, seed=0)
    for layer in (model[0], model[2], model[4], model):
        fully_shard(layer)
    _train_watching_one_layer(model, f"{root}/sharded", rank, dist.get_world_size())


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_the_global_norm_of_a_sharded_model_adds_up_the_unwatched_shards(tmp_path) -> None:
    """FSDP2 on two CPU ranks, one layer watched: the unwatched layers' gradient shards count in
    ``param_grad/global_norm`` and ``step/grad_norm`` combined over the ranks, as one process with the
    whole batch has them."""
    spawn_ranks(_fsdp2_ranks, tmp_path, 2, datetime.timedelta(seconds=30))
    _train_watching_one_layer(mlp(6, 16, 16, 3, seed=0), str(tmp_path / "whole"), 0, 1)
    sharded, whole = read_run(tmp_path / "sharded"), read_run(tmp_path / "whole")
    for tag in ("param_grad/global_norm", "step/grad_norm", "param_grad/norm/2.weight"):
        assert sharded.scalars[tag] == pytest.approx(whole.scalars[tag], rel=1e-5), tag
    model = mlp(6, 16, 16, 3, seed=0)
    model(torch.randn(4, 6, generator=torch.Generator().manual_seed(0))).square().mean().backward()
    assert whole.scalars["param_grad/global_norm"][0] == pytest.approx(_total(list(model.parameters())), rel=1e-5)


class Layer(nn.Linear):
    """A forward-forward layer (pytorch/examples' ``Layer``): a Linear with a ReLU child and its
    own optimizer, trained through ``self.forward``, so no hook of the layer runs while it trains."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__(inputs, outputs)
        self.relu = nn.ReLU()
        self.opt = torch.optim.Adam(self.parameters(), lr=0.03)
        self.threshold = 2.0

    def forward(self, x: Tensor) -> Tensor:
        direction = x / (x.norm(2, 1, keepdim=True) + 1e-4)
        return self.relu(torch.mm(direction, self.weight.T) + self.bias.unsqueeze(0))  # type: ignore[no-any-return]

    def train_step(self, positive: Tensor, negative: Tensor) -> tuple[Tensor, Tensor]:
        good, bad = self.forward(positive).pow(2).mean(1), self.forward(negative).pow(2).mean(1)
        loss = torch.log(1 + torch.exp(torch.cat([-good + self.threshold, bad - self.threshold]))).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return self.forward(positive).detach(), self.forward(negative).detach()


def test_a_linear_subclass_with_a_child_is_watched_by_default(tmp_path) -> None:
    """The layer owns its weight and bias, so the default selection watches it, child or not; called
    as a module, it is logged as any layer."""
    layer = Layer(4, 3)
    with HookLogger(layer, log_dir=tmp_path, every=1) as hooks:
        assert hooks.module_names == ("root",)
        layer(torch.randn(5, 4)).sum().backward()
        expected = _total(list(layer.parameters()))
        hooks.step()
    run = read_run(tmp_path)
    assert {"activation/mean/root", "gradient/norm/root", "param_grad/norm/root.weight"} <= set(run.scalars)
    assert run.scalar("param_grad/global_norm", 0) == pytest.approx(expected, rel=1e-5)


def _forward_forward(tmp_path: object, **options: object) -> list[warnings.WarningMessage]:
    """Two forward-forward layers trained one after the other through ``self.forward``; each
    optimizer step is a logged step. The warnings the logger gave."""
    torch.manual_seed(0)
    net = nn.Sequential(Layer(8, 16), Layer(16, 16))
    positive, negative = torch.randn(32, 8) + 1.0, torch.randn(32, 8) - 1.0
    with warnings.catch_warnings(record=True) as caught, HookLogger(net, log_dir=tmp_path, every=1, **options) as hooks:  # type: ignore[arg-type]
        warnings.simplefilter("always")
        for layer in net:
            inputs = positive, negative
            for _ in range(3):
                positive, negative = layer.train_step(*inputs)  # (what the next layer trains on)
                hooks.step()
    return [w for w in caught if "recorded no call" in str(w.message)]


def test_forward_forward_layers_trained_through_self_forward_are_said_once(tmp_path) -> None:
    """Neither layer's forward hook ran in any logged step, though their gradients were read: one
    warning, at the first such step (the first layer's), says why and what to do, and points at the
    user's ``step()``; none for the second layer's steps (one per logger)."""
    said = _forward_forward(tmp_path)
    assert len(said) == 1
    message = str(said[0].message)
    assert "module(s) '0' recorded no call" in message
    assert "self.forward(x)" in message and "layer(x), not layer.forward(x)" in message
    assert said[0].filename == __file__
    run = read_run(tmp_path)
    assert "activation/mean/0" not in run.scalars  # (what the warning is about)
    assert set(run.scalars["param_grad/norm/0.weight"]) == {0, 1, 2}


def _train_attention(log_dir, **options: object) -> list[warnings.WarningMessage]:
    """Three logged steps of the word-language-model Transformer; the "recorded no call" warnings."""
    torch.manual_seed(0)
    model = WordTransformer()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with (
        warnings.catch_warnings(record=True) as caught,
        HookLogger(model, log_dir=log_dir, every=1, **options) as hooks,
    ):
        warnings.simplefilter("always")
        for _ in range(3):
            src = torch.randint(0, 20, (7, 3))
            F.nll_loss(model(src).flatten(0, 1), src.flatten()).backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
    return [w for w in caught if "recorded no call" in str(w.message)]


def test_a_module_used_functionally_is_said_once_and_called_modules_are_not(tmp_path) -> None:
    """``nn.MultiheadAttention`` uses its ``out_proj``'s weight in the functional attention, never
    calling it: watched without the attention (Linears only), named once for all steps; by default
    the attention is watched too, and its output, which is the out_proj's, is recorded under its
    name: nothing to say. The modules called (the Linears, a BatchNorm kept in eval mode while its
    affine parameters train) are not named."""
    said = _train_attention(tmp_path / "linears", modules=[nn.Linear])
    assert len(said) == 1 and said[0].filename == __file__
    listed = str(said[0].message).split(" recorded no call")[0]
    assert listed.endswith("'encoder.layers.0.self_attn.out_proj', 'encoder.layers.1.self_attn.out_proj'")
    assert _train_attention(tmp_path / "default") == []
    run = read_run(tmp_path / "default")
    assert set(run.scalars["activation/mean/encoder.layers.0.self_attn"]) == {0, 1, 2}

    bn = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    bn[1].eval()  # (frozen statistics, trained affine parameters: called, not recorded without eval_passes)
    with warnings.catch_warnings(record=True) as caught, HookLogger(bn, log_dir=tmp_path / "bn", every=1) as hooks:
        warnings.simplefilter("always")
        bn(torch.randn(8, 4)).sum().backward()
        assert bn[1].weight.grad is not None
        hooks.step()
    assert not [w for w in caught if "recorded no call" in str(w.message)]
