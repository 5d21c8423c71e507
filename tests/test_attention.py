"""``attention=``: per-module and per-head max logit and entropy of every attention call, checked
against an explicit float64 softmax of the very query and key each call received (captured below
autograd with a ``TorchDispatchMode``, independently of the logger's own capture)."""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable

import models
import numpy as np
import pytest
import torch
from conftest import OpCounter, assert_same_weights, read_images, read_run, read_tags, read_tensors
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tblog_hooks import HookLogger, HookLoggerError, Thresholds
from tblog_hooks._compat import full_float32_matmul
from tblog_hooks.cli import main, report
from tblog_hooks.diagnostics.health import default_health
from tblog_hooks.stats.attention import attention_statistics
from tblog_hooks.stats.tags import HEADS_TABLE_TAG

REL = 1e-4


# -- the reference ---------------------------------------------------------------------------------
def reference(q, k, mask=None, causal=False, scale=None):
    """Per head (dim -3): the largest unmasked logit, the summed entropy of the queries that see a
    key, and their count; in float64 with an explicit softmax."""
    q, k = q.double(), k.double()
    if q.dim() == 3:
        q, k = q.unsqueeze(1), k.unsqueeze(1)
    if k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    logits = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    allowed = torch.ones(logits.shape, dtype=torch.bool)
    added = torch.zeros(logits.shape, dtype=torch.float64)
    if causal:
        allowed &= torch.ones(logits.shape[-2:], dtype=torch.bool).tril()
    if mask is not None and mask.dtype == torch.bool:
        allowed &= mask
    elif mask is not None:  # -inf or the dtype's lowest value (Hugging Face's) mask a key out
        allowed &= (mask != -math.inf) & (mask != torch.finfo(mask.dtype).min)
        added = added + mask.double().masked_fill(~allowed, 0.0)
    heads = logits.shape[-3]
    by_head = lambda t: t.movedim(-3, 0).reshape(heads, -1)  # noqa: E731
    peak = by_head(logits.masked_fill(~allowed, -math.inf)).amax(1)
    probs = torch.softmax((logits + added).masked_fill(~allowed, -math.inf), dim=-1)
    terms = torch.where(probs > 0, -probs * probs.log(), torch.zeros(()))
    seen = allowed.any(-1, keepdim=True)
    entropy = by_head(torch.where(seen, terms, 0.0).sum(-1, keepdim=True)).sum(1)
    return peak, entropy, by_head(seen.double()).sum(1)


class _Capture:
    """The innermost of the modules matching ``pattern`` that is running (tracked with forward hooks)."""

    def __init__(self, model: nn.Module, pattern: str) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple]] = []
        self._running: list[str] = []
        self._handles = []
        for name, module in model.named_modules():
            if re.fullmatch(pattern, name):
                self._handles.append(module.register_forward_pre_hook(lambda m, a, n=name: self._running.append(n)))
                self._handles.append(module.register_forward_hook(lambda m, a, o: (self._running.pop(), None)[1]))
        assert self._handles, pattern

    def _add(self, named: dict) -> None:
        if self._running:
            found = [named["query"], named["key"], named.get("attn_mask")]
            found = [None if t is None else t.detach().clone() for t in found]
            self.calls.append((self._running[-1], (*found, named.get("is_causal", False), named.get("scale"))))

    def expected(self) -> dict[str, tuple[float, float]]:
        """``{module: (max logit, mean entropy)}`` pooled over its calls."""
        pooled: dict[str, list] = {}
        for name, (q, k, mask, causal, scale) in self.calls:
            peak, entropy, count = reference(q, k, mask, causal, scale)
            p = pooled.setdefault(name, [-math.inf, 0.0, 0.0])
            p[0] = max(p[0], float(peak.max()))
            p[1] += float(entropy.sum())
            p[2] += float(count.sum())
        return {name: (peak, entropy / count) for name, (peak, entropy, count) in pooled.items()}


class Calls(_Capture, TorchFunctionMode):
    """Every ``F.scaled_dot_product_attention`` call's query, key, mask, causal flag and scale."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is nn.functional.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            self._add(dict(zip(names, args)) | kwargs)
        return func(*args, **kwargs)


class KernelCalls(_Capture, TorchDispatchMode):
    """The same, of every SDPA kernel call below autograd (inside ``F.multi_head_attention_forward`` too)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "scaled_dot_product" in str(func):
            self._add(dict(zip([a.name for a in func._schema.arguments], args)) | kwargs)
        return func(*args, **kwargs)


def check_model(
    tmp_path, model: nn.Module, pattern: str, forward: Callable[[], torch.Tensor], steps: int = 1, capture=Calls
) -> None:
    """Train ``steps`` logged steps with ``attention=True``; every module's tags equal the reference
    computed from the calls ``capture`` saw."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HookLogger(model, log_dir=tmp_path, every=1, attention=True, histograms=False) as hooks:
        expected = []
        for _ in range(steps):
            calls = capture(model, pattern)
            with calls:
                loss = forward()
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
            expected.append(calls.expected())
    run = read_run(tmp_path)
    for step, by_module in enumerate(expected):
        assert by_module, "the reference saw no attention call"
        for name, (peak, entropy) in by_module.items():
            assert run.scalar(f"attention/max_logit/{name}", step) == pytest.approx(peak, rel=REL), name
            assert run.scalar(f"attention/entropy/{name}", step) == pytest.approx(entropy, rel=REL), name
        written = {t.split("/", 2)[2] for t in run.scalars if t.startswith("attention/max_logit/")}
        assert written == set(by_module)


# -- models ----------------------------------------------------------------------------------------
def _padded(ends: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Three sequences of 16 random tokens (vocabulary 50) and their attention mask: row ``r``
    padded from position ``ends[r]`` on."""
    tokens = torch.randint(0, 50, (3, 16))
    padding = torch.ones(3, 16, dtype=torch.long)
    for row, end in ends.items():
        padding[row, end:] = 0
    return tokens, padding


def test_gpt2_causal_and_padded(tmp_path) -> None:
    model = models.gpt2(32, 50)
    tokens, padding = _padded({1: 10, 2: 4})

    def forward():
        return model(tokens, attention_mask=padding, labels=tokens).loss

    check_model(tmp_path, model, r"transformer\.h\.\d+\.attn", forward, steps=2)


def test_micro_batches_and_checkpointing_count_each_call_once(tmp_path) -> None:
    """Two forward passes per step pool; a checkpoint's recompute in backward is not counted again."""
    model = models.gpt2(32, 50)
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    a, b = torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (3, 16))

    def forward():
        return model(a, labels=a).loss + model(b, labels=b).loss

    check_model(tmp_path, model, r"transformer\.h\.\d+\.attn", forward)


def _encoder_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True) for _ in range(2)])


CHECKPOINTED = {
    "checkpoint_sequential": lambda model, x: torch.utils.checkpoint.checkpoint_sequential(
        model, 2, x, use_reentrant=False
    ),
    "checkpoint_sequential_reentrant": lambda model, x: torch.utils.checkpoint.checkpoint_sequential(
        model, 2, x, use_reentrant=True
    ),
    "whole_model_reentrant": lambda model, x: torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True),
}


@pytest.mark.parametrize("how", CHECKPOINTED)
def test_calls_without_the_models_forward_and_reentrant_checkpoints_are_recorded(tmp_path, how) -> None:
    """checkpoint_sequential calls the model's children, not its forward; a reentrant checkpoint
    runs its first pass without gradients and recomputes it in backward: recorded once each."""
    model = _encoder_stack()
    x = torch.randn(2, 6, 16, requires_grad=True)
    run = CHECKPOINTED[how]
    check_model(tmp_path, model, r"\d+\.self_attn", lambda: run(model, x).square().mean(), steps=2, capture=KernelCalls)


def test_lightning_training_step_calling_submodules_is_recorded(tmp_path) -> None:
    """A LightningModule whose training_step calls its submodules, never its own forward."""
    pl = pytest.importorskip("lightning.pytorch")
    from tblog_hooks.integrations.lightning import HookLoggerCallback

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.encoder, self.head = _encoder_stack(), nn.Linear(16, 1)

        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            return (self.head(self.encoder(batch[0])) - batch[1]).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(8, 6, 16), torch.randn(8, 6, 1))
    net = Net()
    calls = KernelCalls(net, r"encoder\.\d+\.self_attn")
    trainer = models.lightning_trainer(tmp_path, [HookLoggerCallback(attention=True, every=1)], max_steps=1)
    with calls:
        trainer.fit(net, torch.utils.data.DataLoader(data, batch_size=4))
    expected = calls.expected()
    assert set(expected) == {"encoder.0.self_attn", "encoder.1.self_attn"}
    run = read_run(trainer.logger.log_dir)
    for name, (peak, entropy) in expected.items():
        assert run.scalar(f"attention/max_logit/{name}", 0) == pytest.approx(peak, rel=REL), name
        assert run.scalar(f"attention/entropy/{name}", 0) == pytest.approx(entropy, rel=REL), name


def test_a_forward_that_raises_leaves_no_mode_behind(tmp_path) -> None:
    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            nn.functional.scaled_dot_product_attention(x, x, x)
            raise ValueError("bad batch")

    model = nn.Sequential(nn.Linear(4, 4), Failing())
    with HookLogger(model, log_dir=tmp_path, every=1, attention=True) as hooks:
        with pytest.raises(ValueError, match="bad batch"):
            model(torch.randn(2, 3, 4))
        assert torch.overrides._get_current_function_mode_stack() == []
        hooks.step()
    assert "attention/max_logit/1" in read_run(tmp_path).scalars


def test_llama_grouped_query_attention(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    tokens = torch.randint(0, 50, (2, 12))
    check_model(tmp_path, model, r"model\.layers\.\d+\.self_attn", lambda: model(tokens, labels=tokens).loss)


def test_bert_padding_mask(tmp_path) -> None:
    model = models.bert(32, 50)
    tokens, padding = _padded({0: 5, 2: 12})
    check_model(
        tmp_path,
        model,
        r"bert\.encoder\.layer\.\d+\.attention\.self",
        lambda: model(tokens, attention_mask=padding, labels=tokens).loss,
    )


def test_t5_padded_encoder_and_cross_attention(tmp_path) -> None:
    """T5 masks padded keys with ``torch.finfo(dtype).min`` added to the logits (with its position
    bias): they are masked, in the max logit too (its cross-attention sees the encoder's padding)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=50, d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, decoder_start_token_id=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    tokens, padding = _padded({0: 5, 2: 12})
    labels = torch.randint(0, 50, (3, 7))
    forward = lambda: model(tokens, attention_mask=padding, labels=labels).loss  # noqa: E731
    check_model(tmp_path, model, r"(encoder|decoder)\.block\.\d+\.layer\.\d+\.(SelfAttention|EncDecAttention)", forward)


class _Attend(nn.Module):
    """One ``scaled_dot_product_attention`` call of ``x`` (times a learnt factor) with itself."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q = x * self.factor
        return nn.functional.scaled_dot_product_attention(q, x, x, attn_mask=mask)


def _attended(tmp_path, x: torch.Tensor, mask: torch.Tensor | None = None, autocast=None) -> tuple[float, float]:
    """``attention/max_logit`` and ``attention/entropy`` of one logged step of :class:`_Attend`."""
    model = _Attend()
    with HookLogger(model, log_dir=tmp_path, every=1, attention=True, histograms=False) as hooks:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            out = model(x, mask)
        out.float().sum().backward()
        hooks.step()
    run = read_run(tmp_path)
    return run.scalar("attention/max_logit/root", 0), run.scalar("attention/entropy/root", 0)


def test_a_lowest_value_float_mask_reads_as_the_bool_mask(tmp_path) -> None:
    """Hugging Face's ``torch.finfo(dtype).min`` masks the keys a bool mask does: the same values."""
    x = torch.randn(2, 2, 6, 8)
    x[:, :, 4:] *= 10  # the masked keys have the largest logits
    allowed = torch.ones(6, 6, dtype=torch.bool)
    allowed[:, 4:] = False
    for dtype in (torch.float32, torch.bfloat16):
        lowest = torch.zeros(6, 6, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
        with_bool = _attended(tmp_path / f"bool-{dtype}", x.to(dtype), allowed)
        with_lowest = _attended(tmp_path / f"lowest-{dtype}", x.to(dtype), lowest)
        assert with_lowest == pytest.approx(with_bool, rel=1e-6), dtype
        peak, entropy, count = reference(x.to(dtype)[:, :, :, :], x.to(dtype), allowed)
        assert with_bool == pytest.approx((float(peak.max()), float(entropy.sum() / count.sum())), rel=REL)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_statistics_are_float32_under_autocast(tmp_path, dtype) -> None:
    """Under autocast the logits are recomputed in float32 from the call's (low-precision) query and
    key: equal to float64 from the same tensors; under fp16 an unscaled q·kᵀ of 74,000 does not overflow."""
    big = 36.0 if dtype == torch.float16 else 3.0
    x = (torch.randn(2, 2, 8, 64) * big).to(dtype)
    got = _attended(tmp_path, x, autocast=dtype)
    assert (x[0, 0].float() @ x[0, 0].float().T).abs().max() > 65504 or dtype != torch.float16
    peak, entropy, count = reference(x, x)
    assert got == pytest.approx((float(peak.max()), float(entropy.sum() / count.sum())), rel=REL, abs=1e-6)


def test_gpt2_under_bf16_autocast(tmp_path) -> None:
    model = models.gpt2(32, 50)
    tokens, padding = _padded({1: 10})

    def forward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(tokens, attention_mask=padding, labels=tokens).loss

    check_model(tmp_path, model, r"transformer\.h\.\d+\.attn", forward)


def test_timm_vit(tmp_path) -> None:
    model = models.timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
    images = torch.randn(2, 3, 32, 32)
    check_model(tmp_path, model, r"blocks\.\d+\.attn", lambda: model(images).square().mean())


def test_torchvision_vit(tmp_path) -> None:
    from torchvision.models import VisionTransformer

    model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)
    images = torch.randn(2, 3, 32, 32)
    check_model(
        tmp_path,
        model,
        r"encoder\.layers\.encoder_layer_\d+\.self_attention",
        lambda: model(images).square().mean(),
        capture=KernelCalls,
    )


def test_transformer_encoder_with_masks(tmp_path) -> None:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 10, 32)
    padding = torch.zeros(2, 10, dtype=torch.bool)
    padding[1, 6:] = True  # nn.MultiheadAttention: True is masked out
    causal = torch.ones(10, 10, dtype=torch.bool).triu(1)  # True: masked out

    def forward():
        return model(x, mask=causal, src_key_padding_mask=padding).square().mean()

    check_model(tmp_path, model, r"layers\.\d+\.self_attn", forward, capture=KernelCalls)


def test_multihead_attention_with_weights(tmp_path) -> None:
    """``need_weights=True`` computes the softmax without SDPA: the values are the same."""
    model = nn.MultiheadAttention(16, 2, batch_first=True, bias=True)
    x = torch.randn(2, 7, 16)
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[0, 4:] = True
    with HookLogger(model, log_dir=tmp_path, every=1, attention=True, histograms=False) as hooks:
        out, _ = model(x, x, x, key_padding_mask=padding)
        out.square().mean().backward()
        hooks.step()
    w_q, w_k, _ = model.in_proj_weight.detach().chunk(3)
    b_q, b_k, _ = model.in_proj_bias.detach().chunk(3)
    q = (x @ w_q.T + b_q).reshape(2, 7, 2, 8).transpose(1, 2)
    k = (x @ w_k.T + b_k).reshape(2, 7, 2, 8).transpose(1, 2)
    peak, entropy, count = reference(q, k, (~padding)[:, None, None, :])
    run = read_run(tmp_path)
    assert run.scalar("attention/max_logit/root", 0) == pytest.approx(float(peak.max()), rel=REL)
    assert run.scalar("attention/entropy/root", 0) == pytest.approx(float(entropy.sum() / count.sum()), rel=REL)


# -- the statistics themselves ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "case", ["plain", "causal", "bool_mask", "float_mask", "lowest_mask", "gqa", "scale", "three_dims", "masked_row"]
)
def test_statistics_per_head(case) -> None:
    q, k = torch.randn(2, 4, 9, 8) * 3, torch.randn(2, 4, 11, 8) * 3
    mask, causal, scale = None, False, None
    if case == "causal":
        k, causal = torch.randn(2, 4, 9, 8), True
    elif case in ("bool_mask", "masked_row"):
        mask = torch.rand(2, 1, 9, 11) > 0.3
        if case == "masked_row":
            mask[0, 0, 3] = False  # a query that sees no key
    elif case == "float_mask":
        mask = torch.randn(1, 4, 9, 11)
        mask[..., 5] = -math.inf
    elif case == "lowest_mask":  # Hugging Face's, with a bias added (it stays the lowest value)
        mask = torch.randn(1, 4, 9, 11).masked_fill(torch.rand(1, 4, 9, 11) > 0.6, torch.finfo(torch.float32).min)
        mask = mask + torch.randn(1, 4, 9, 11)
    elif case == "gqa":
        k = torch.randn(2, 2, 11, 8)
    elif case == "scale":
        scale = 0.7
    elif case == "three_dims":
        q, k = q[0], k[0]
    got = attention_statistics(q, k, mask, causal, scale)
    want = reference(q, k, mask, causal, scale)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=REL, atol=0)


class MatmulPrecision(TorchFunctionMode):
    """The float32 precision of the CPU's and of CUDA's matmuls at each ``torch.matmul`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.matmul:
            self.seen.append(_precisions())
        return func(*args, **(kwargs or {}))


def _precisions() -> tuple[str, str]:
    return torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.fp32_precision


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_logits_are_full_float32_whatever_the_matmul_precision(device) -> None:
    """``torch.set_float32_matmul_precision("high")`` lets cuBLAS use TF32 and oneDNN bf16/TF32
    (the largest logit moved by ~1e-3 on CUDA); the recompute runs in IEEE float32 on the
    device of its tensors, and the user's setting reads as before afterwards. The CUDA flag is
    a flag: it is set and read without a GPU."""
    q, k = torch.randn(2, 4, 9, 8), torch.randn(2, 4, 11, 8)
    torch.set_float32_matmul_precision("high")
    try:
        user = _precisions()
        spy = MatmulPrecision()
        with spy:
            if device == "cpu":
                attention_statistics(q, k)
            else:
                with full_float32_matmul(torch.device("cuda")):
                    torch.matmul(q, k.transpose(-1, -2))
        assert spy.seen and all(seen[device == "cuda"] == "ieee" for seen in spy.seen)
        assert _precisions() == user and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision("highest")


class Sizes(TorchDispatchMode):
    """The largest output of any op, in bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view (expand, slice) allocates nothing
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def test_chunks_bound_the_memory() -> None:
    """A small budget splits the queries: no temporary exceeds it, the values stay the same."""
    q, k = torch.randn(1, 2, 300, 16), torch.randn(1, 2, 300, 16)
    mask = torch.rand(1, 1, 300, 300) > 0.5
    budget = 1 << 16  # a chunk of 2 x 300 keys x 4 bytes x 3 temporaries: 9 queries
    sizes = Sizes()
    with sizes:
        got = attention_statistics(q, k, mask, True, budget=budget)
    assert sizes.largest <= budget  # the whole logits would take 2 * 300 * 300 * 4 = 720 kB
    for g, w in zip(got, attention_statistics(q, k, mask, True)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=0)


# -- cost and training ---------------------------------------------------------------------------


def _gpt2_step(model: nn.Module, tokens: torch.Tensor, opt: torch.optim.Optimizer) -> None:
    model(tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()


def test_unlogged_steps_add_no_op_and_training_is_unchanged(tmp_path) -> None:
    torch.manual_seed(1)
    plain = models.gpt2(32, 50)
    torch.manual_seed(1)
    logged = models.gpt2(32, 50)
    tokens = torch.randint(0, 50, (2, 16))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, logged)]
    with HookLogger(logged, log_dir=tmp_path, every=3, attention=True, histograms=False) as hooks:
        counts = []
        for step in range(4):  # steps 0 and 3 are logged
            for model, opt in zip((plain, logged), opts):
                ops = OpCounter()
                torch.manual_seed(step)  # the same dropout in both
                with ops:
                    _gpt2_step(model, tokens, opt)
                counts.append(ops.ops)
            hooks.step()
    assert_same_weights(plain, logged)
    plain_ops, logged_ops = counts[0::2], counts[1::2]
    assert logged_ops[1] == plain_ops[1] and logged_ops[2] == plain_ops[2]  # steps 1 and 2: not logged
    assert sum(logged_ops[0].values()) > sum(plain_ops[0].values())  # the logged step's statistics
    assert sorted(read_run(tmp_path).scalars["attention/max_logit/transformer.h.0.attn"]) == [0, 3]


def test_a_model_without_attention_gets_no_attention_tag(tmp_path) -> None:
    model = models.mlp(4, 8, 2)
    with HookLogger(model, log_dir=tmp_path, every=1, attention=True) as hooks:
        models.train(hooks, (model(torch.randn(3, 4)).sum() for _ in range(2)))
    assert not [t for t in read_tags(tmp_path)["scalars"] if t.startswith("attention/")]
    assert read_run(tmp_path).scalars["activation/mean/0"]


def test_selectors_cover_a_module_and_what_runs_inside_it(tmp_path) -> None:
    model = models.gpt2(32, 50)
    tokens = torch.randint(0, 50, (2, 8))
    with HookLogger(model, log_dir=tmp_path, every=1, attention=["transformer.h.1"], histograms=False) as hooks:
        models.train(hooks, [model(tokens, labels=tokens).loss])
    tags = [t for t in read_tags(tmp_path)["scalars"] if t.startswith("attention/")]
    assert sorted(tags) == ["attention/entropy/transformer.h.1.attn", "attention/max_logit/transformer.h.1.attn"]


def test_bad_attention_option() -> None:
    model = models.mlp(4, 2)
    with pytest.raises(HookLoggerError, match=r"attention= (?s:.*)'nope'"):
        HookLogger(model, attention=["nope"])
    with pytest.raises(HookLoggerError, match="attention must be True, False"):
        HookLogger(model, attention=[])


# -- findings and pictures -------------------------------------------------------------------------
ATTENTION_FINDINGS = {"attention_logit_growth", "attention_entropy_collapse"}


def _scale_query_key(model: nn.Module, block: int, factor: float) -> None:
    """Multiply the query and key projections of one GPT-2 block by ``factor`` (logits by its square)."""
    c_attn = model.transformer.h[block].attn.c_attn
    width = c_attn.weight.shape[0]
    with torch.no_grad():
        c_attn.weight[:, : 2 * width] *= factor
        c_attn.bias[: 2 * width] *= factor


def test_scaled_query_and_key_weights_are_found_in_their_block_only(tmp_path, capsys) -> None:
    """Four healthy logged steps, then one block's query and key weights x30 (its logits x900):
    the next step's logits are judged against each block's own course, and that block is named."""
    model = models.gpt2(32, 50)
    tokens = torch.randint(0, 50, (4, 16))
    with HookLogger(model, log_dir=tmp_path, every=1, attention=True, histograms=False) as hooks:
        models.train(hooks, (model(tokens, labels=tokens).loss for _ in range(4)))
        _scale_query_key(model, 1, 30.0)
        models.train(hooks, [model(tokens, labels=tokens).loss])
    found = [f for f in hooks.findings if f.kind in ATTENTION_FINDINGS]
    assert {f.kind for f in found} == ATTENTION_FINDINGS
    assert {(f.module, f.step) for f in found} == {("transformer.h.1.attn", 4)}
    assert all("(head " in f.message for f in found)
    run = read_run(tmp_path)
    assert run.scalar("health/attention_logit_growth", 4) == 1
    assert run.scalar("health/attention_entropy_collapse", 4) == 1
    assert run.scalar("health/attention_logit_growth", 3) == 0
    pictures = read_images(tmp_path, "health/attention_entropy")
    assert sorted(pictures) == [0, 1, 2, 3, 4]  # (their layout: tests/test_charts.py)
    # The report replays them from the attention/* scalars (the module, not the head), and fails on them.
    (loaded,) = report.load_all(tmp_path, "run")
    replayed = [(f.kind, f.step, f.module) for f in report.findings(loaded) if f.kind in ATTENTION_FINDINGS]
    assert sorted(replayed) == sorted((f.kind, f.step, f.module) for f in found)
    assert main(["report", str(tmp_path), "--fail-on", "attention_logit_growth"]) == 1
    assert "step 4: attention_logit_growth [transformer.h.1.attn]" in capsys.readouterr().out


class _Block(nn.Module):
    """A pre-norm transformer block calling SDPA (causal), with or without qk-layernorm (a learnable
    LayerNorm on each head's queries and keys, as Wortsman et al. 2023 and OLMo-2 use)."""

    def __init__(self, width: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        norm = (lambda: nn.LayerNorm(width // heads)) if qk_norm else nn.Identity
        self.q_norm, self.k_norm = norm(), norm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class _CopyNet(nn.Module):
    """Two blocks over 15 tokens of a vocabulary of 16 (a sequence of 8 and its repeat, less its last)."""

    def __init__(self, qk_norm: bool) -> None:
        super().__init__()
        self.embed, self.position = nn.Embedding(16, 32), nn.Parameter(torch.randn(16, 32) * 0.02)
        self.blocks = nn.ModuleList(_Block(32, 2, qk_norm) for _ in range(2))
        self.head = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 16))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        z = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            z = block(z)
        return self.head(z)


def _copy_run(tmp_path, qk_norm: bool, steps: int = 150) -> tuple[list[float], HookLogger]:
    """AdamW at lr 3e-2 on the copy task (the second half of each sequence repeats the first):
    with qk-layernorm it learns to copy (a head attends to one key); without, its logits grow
    unchecked and it learns nothing. Logged every 5 steps."""
    torch.manual_seed(0)
    model = _CopyNet(qk_norm)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.0)
    data = torch.Generator().manual_seed(0)
    losses = []
    watched = dict(modules=["blocks", "head.1"], logits=["head.1"])  # (its output layer: log Z, for logit_drift)
    with HookLogger(model, log_dir=tmp_path, every=5, attention=True, histograms=False, **watched) as hooks:
        for _ in range(steps):
            first = torch.randint(0, 16, (32, 8), generator=data)
            tokens = torch.cat([first, first], 1)
            loss = nn.functional.cross_entropy(model(tokens[:, :-1])[:, 7:].reshape(-1, 16), first.reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            hooks.step()
            losses.append(loss.item())
    return losses, hooks


def test_a_stable_qk_layernorm_run_that_learns_to_copy_has_no_attention_finding(tmp_path) -> None:
    """Its copy head reaches 0.3 nats at the task's floor loss, with logits of the size it started with."""
    losses, hooks = _copy_run(tmp_path, qk_norm=True)
    assert losses[-1] < 0.01 < 2.5 < losses[0]  # it learns the task
    heads = read_tensors(tmp_path, HEADS_TABLE_TAG)
    assert min(float(np.nanmin(t[..., 1])) for t in heads.values()) < 0.3  # a head attends to about one key
    assert max(float(np.nanmax(t[..., 0])) for t in heads.values()) > 10  # its logits grew 5-fold
    assert not [f for f in hooks.findings if f.kind in ATTENTION_FINDINGS]
    # Its log Z climbs over 10 nats as it grows confident (a loss of 1e-3 needs it), short of a drift.
    log_z = read_run(tmp_path).scalars["activation/log_z/head.1"]
    assert log_z[145] - log_z[0] > 10
    assert not [f for f in hooks.findings if f.kind == "logit_drift"]


def test_an_unstable_run_without_qk_norm_is_caught_early(tmp_path) -> None:
    """The same run without qk-layernorm: both findings start in block 0 within 50 steps, while its
    logits keep growing (50-fold by step 55, 500-fold by step 150) and its loss never falls below 2.4."""
    losses, hooks = _copy_run(tmp_path, qk_norm=False, steps=60)
    assert min(losses) > 2.4
    first = {}
    for f in hooks.findings:
        first.setdefault((f.kind, f.module), f.step)
    assert first[("attention_logit_growth", "blocks.0")] <= 25
    assert first[("attention_entropy_collapse", "blocks.0")] <= 50
    assert read_run(tmp_path).scalar("attention/max_logit/blocks.0", 55) > 50


def _healthy(name: str) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    transformers = pytest.importorskip("transformers")
    tokens = torch.randint(0, 50, (2, 16))
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[1, 9:] = 0
    if name == "gpt2":
        model = models.gpt2(32, 50)
        return model, lambda: model(tokens, labels=tokens).loss
    if name == "llama":
        config = transformers.LlamaConfig(
            vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=32, attn_implementation="sdpa",
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(config)
        return model, lambda: model(tokens, labels=tokens).loss
    if name == "bert":
        model = models.bert(32, 50)
        return model, lambda: model(tokens, attention_mask=padding, labels=tokens).loss
    images = torch.randn(2, 3, 32, 32)
    if name == "vit":
        model = models.timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)
        labels = torch.randint(0, 10, (2,))
        return model, lambda: nn.functional.cross_entropy(model(images), labels)
    if name == "torchvision_vit":
        from torchvision.models import VisionTransformer

        model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)
        labels = torch.randint(0, 1000, (2,))
        return model, lambda: nn.functional.cross_entropy(model(images), labels)
    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
    model = nn.Sequential(nn.Embedding(50, 32), nn.TransformerEncoder(layer, 2, enable_nested_tensor=False))
    return model, lambda: model(tokens).square().mean()


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "vit", "torchvision_vit", "encoder"])
def test_healthy_models_have_no_attention_finding(tmp_path, name) -> None:
    """At init and after 40 AdamW steps."""
    model, forward = _healthy(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with HookLogger(model, log_dir=tmp_path, every=40, attention=True, histograms=False) as hooks:
        models.train(hooks, (forward() for _ in range(41)), opt)
    run = read_run(tmp_path)
    assert sorted(run.scalars[next(t for t in run.scalars if t.startswith("attention/max_logit/"))]) == [0, 40]
    assert not [f for f in hooks.findings if f.kind in ATTENTION_FINDINGS]


def test_growth_over_the_run_own_history() -> None:
    """Growth is of the logits' magnitude against the layer's lowest recent one (at least 1): from
    0.3 to 9 is soft attention still, to 40 it is not; logits that all turn very negative grow too."""
    health = default_health(Thresholds())
    for step, peak in enumerate([0.2, 0.3, 0.25, 0.3]):
        assert not health.update(step, {"attention/max_logit/a": peak, "attention/entropy/a": 2.0}, [])
    assert not health.update(4, {"attention/max_logit/a": 9.0, "attention/entropy/a": 0.1}, [])  # below 10
    (found,) = health.update(5, {"attention/max_logit/a": 40.0, "attention/entropy/a": 2.0}, [])
    assert (found.kind, found.module, found.value) == ("attention_logit_growth", "a", 40.0)
    assert "40 times the lowest of its recent logged steps (1)" in found.message
    health = default_health(Thresholds())
    for step, peak in enumerate([-2.0, -3.0, -2.5]):
        assert not health.update(step, {"attention/max_logit/a": peak, "attention/entropy/a": 1.5}, [])
    found = health.update(3, {"attention/max_logit/a": -1170.0, "attention/entropy/a": 0.04}, [])
    assert {f.kind for f in found} == ATTENTION_FINDINGS  # every logit at or below -1,170: one-hot


# -- torch.compile ---------------------------------------------------------------------------------
def test_compiled_model_warns_once_and_logs_no_attention(tmp_path) -> None:
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    with HookLogger(model, log_dir=tmp_path, every=1, attention=True, histograms=False) as hooks:
        compiled = torch.compile(model, backend="eager")
        with pytest.warns(RuntimeWarning, match="attention= records nothing inside torch.compile") as caught:
            models.train(hooks, (compiled(torch.randn(2, 5, 16)).square().mean() for _ in range(3)))
    assert sum("torch.compile" in str(w.message) for w in caught) == 1
    tags = read_tags(tmp_path)["scalars"]
    assert "activation/mean/layers.0.linear1" in tags
    assert not [t for t in tags if t.startswith("attention/")]


@pytest.mark.skipif(not hasattr(torch.compiler, "set_stance"), reason="torch.compiler.set_stance: torch 2.6 and later")
def test_compiled_model_whose_logged_steps_run_eagerly_logs_the_eager_values(tmp_path) -> None:
    """The recipe of docs/attention.md: the logged steps' forward under set_stance("force_eager")."""
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
    twin = copy.deepcopy(model)
    x = torch.randn(2, 5, 16)
    with HookLogger(twin, log_dir=tmp_path / "eager", every=2, attention=True, histograms=False) as hooks:
        models.train(hooks, (twin(x).square().mean() for _ in range(3)))
    with HookLogger(model, log_dir=tmp_path / "compiled", every=2, attention=True, histograms=False) as hooks:
        compiled = torch.compile(model, backend="aot_eager")
        for _ in range(3):
            with torch.compiler.set_stance("force_eager" if hooks.recording else "default"):
                loss = compiled(x).square().mean()
            loss.backward()
            hooks.step()
    eager, got = read_run(tmp_path / "eager").scalars, read_run(tmp_path / "compiled").scalars
    attention = {t: v for t, v in eager.items() if t.startswith("attention/")}
    assert len(attention) == 2 and all(sorted(v) == [0, 2] for v in attention.values())
    assert {t: v for t, v in got.items() if t.startswith("attention/")} == attention
