"""``attention=`` records ``flex_attention`` (its ``score_mod`` and block mask applied to the
recomputed logits) and ``varlen_attn`` (packed sequences) calls, eager or compiled as torchtitan
0.3.0 calls them, checked against an explicit float64 softmax of the very query and key each call
received, masked and score-modded by the test's own broadcast arithmetic. On the CPU,
FlexAttention has no backward and ``varlen_attn`` no kernel: the forward passes run without
gradients, and a CPU kernel for the op ``varlen_attn`` calls is registered here (per-sequence
SDPA), below the call the logger sees."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import read_run
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.nn.attention.varlen import varlen_attn

from tblog_hooks import HookLogger

REL = 1e-4


def per_head(scores: torch.Tensor, allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per head (dim 1 of ``(B, heads, L, S)``): the largest allowed score, the summed entropy of
    the queries that see a key and their count, with an explicit float64 softmax."""
    scores, allowed = scores.double(), allowed.expand(scores.shape)
    heads = scores.shape[1]
    by_head = lambda t: t.transpose(0, 1).reshape(heads, -1)  # noqa: E731
    blocked = scores.masked_fill(~allowed, -math.inf)
    probs = torch.softmax(blocked, dim=-1).nan_to_num(0.0)
    terms = torch.where(probs > 0, -probs * probs.log(), torch.zeros(()))
    seen = allowed.any(-1)
    return by_head(blocked).amax(1), by_head(terms.sum(-1)).sum(1), by_head(seen.double()).sum(1)


def pooled(calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[float, float]:
    """A module's ``(max logit, mean entropy)`` over its calls' per-head values."""
    peak = max(float(p.max()) for p, _, _ in calls)
    return peak, sum(float(e.sum()) for _, e, _ in calls) / sum(float(c.sum()) for _, _, c in calls)


def check_run(log_dir: Path, expected: dict[str, tuple[float, float]]) -> None:
    run = read_run(log_dir)
    written = {t.split("/", 2)[2] for t in run.scalars if t.startswith("attention/max_logit/")}
    assert written == set(expected)
    for name, (peak, entropy) in expected.items():
        assert run.scalar(f"attention/max_logit/{name}", 0) == pytest.approx(peak, rel=REL), name
        assert run.scalar(f"attention/entropy/{name}", 0) == pytest.approx(entropy, rel=REL), name


def logged_forward(log_dir: Path, model: nn.Module, forward: Callable[[], object]) -> None:
    """One logged step of ``forward`` without gradients (none on the CPU here), training mode."""
    model.requires_grad_(False)
    with HookLogger(model, log_dir=log_dir, every=1, attention=True, histograms=False) as hooks:
        forward()
        hooks.step()


# -- flex_attention --------------------------------------------------------------------------------
HEADS, LENGTH, DIM = 4, 40, 8


def alibi(score, b, h, q_idx, kv_idx):  # (broadcasts: the reference calls it on whole index grids)
    return score + 0.5 * (h + 1) * torch.tanh((kv_idx - q_idx) / 4.0) + 0.25 * b


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):  # (causal within 12 keys: blocks of 16 are partly, wholly or not seen)
    return (q_idx >= kv_idx) & (q_idx - kv_idx < 12)


class Flex(nn.Module):
    """Projects ``(B, L, HEADS * DIM)`` into grouped-query heads and calls ``attend``."""

    def __init__(self, attend: Callable[..., torch.Tensor], kv_heads: int) -> None:
        super().__init__()
        self.q, self.kv = nn.Linear(HEADS * DIM, HEADS * DIM), nn.Linear(HEADS * DIM, 2 * kv_heads * DIM)
        self.attend, self.kv_heads = attend, kv_heads
        self.seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, **mods: object) -> torch.Tensor:
        batch = x.shape[0]
        q = self.q(x).view(batch, LENGTH, HEADS, DIM).transpose(1, 2)
        k, v = self.kv(x).view(batch, LENGTH, 2, self.kv_heads, DIM).permute(2, 0, 3, 1, 4)
        out = self.attend(q, k, v, enable_gqa=self.kv_heads != HEADS, **mods)
        self.seen.append((q, k, v, out))
        return out


def flex_reference(q, k, v, out, score_mod, mask_mod, scale=None) -> tuple[torch.Tensor, ...]:
    """The per-head values of one flex call, from its mods on index grids; its attention output
    is the call's own (so the reference is the attention the kernel computed)."""
    q, k, v = q.double(), k.double(), v.double()
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    b, h, i, j = (
        torch.arange(n).view([-1 if d == n_d else 1 for d in range(4)])
        for n_d, n in enumerate([*q.shape[:3], k.shape[2]])
    )
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    scores = scores if score_mod is None else score_mod(scores, b, h, i, j)
    allowed = mask_mod(b, h, i, j).expand(scores.shape)
    torch.testing.assert_close(
        torch.softmax(scores.masked_fill(~allowed, -math.inf), -1) @ v, out.double(), rtol=1e-4, atol=1e-5
    )
    return per_head(scores, allowed)


@pytest.mark.parametrize(
    ("mask_mod", "score_mod", "kv_heads", "compiled"),
    [(causal, alibi, HEADS, False), (window, None, 2, False), (window, alibi, 2, True)],
    ids=["causal_alibi", "window_gqa", "compiled_window_alibi_gqa"],
)
def test_flex_attention_calls_are_recorded(tmp_path: Path, mask_mod, score_mod, kv_heads: int, compiled: bool) -> None:
    torch.manual_seed(0)
    model = Flex(torch.compile(flex_attention) if compiled else flex_attention, kv_heads)
    mask = create_block_mask(mask_mod, 2, None, LENGTH, LENGTH, device="cpu", BLOCK_SIZE=16)
    x = torch.randn(2, LENGTH, HEADS * DIM) * 2
    logged_forward(tmp_path, model, lambda: model(x, score_mod=score_mod, block_mask=mask))
    check_run(tmp_path, {"root": pooled([flex_reference(*call, score_mod, mask_mod) for call in model.seen])})


# -- varlen_attn -----------------------------------------------------------------------------------
def _cpu_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None, window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):  # fmt: skip  # noqa: E501
    """The op ``varlen_attn`` calls, on the CPU: each sequence's SDPA (windows: not needed here)."""
    out = torch.zeros_like(query)
    starts_q, starts_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    for d in range(len(starts_q) - 1):
        q, k, v = (
            t[s[d] : s[d + 1]].transpose(0, 1) for t, s in ((query, starts_q), (key, starts_k), (value, starts_k))
        )
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        out[starts_q[d] : starts_q[d + 1]] = attended.transpose(0, 1)
    lse = torch.zeros(query.shape[1], query.shape[0], dtype=torch.float)
    return out, lse, torch.zeros(2, dtype=torch.uint64)


@pytest.fixture(scope="module")
def cpu_varlen() -> None:
    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", _cpu_varlen)


def varlen_reference(
    q, k, starts_q: list[int], starts_k: list[int], window: tuple[int, int]
) -> tuple[torch.Tensor, ...]:
    """The per-head values of one varlen call, sequence by sequence: query ``i`` of a sequence sees
    key ``j`` where ``i + (len_k - len_q) - left <= j <= i + (len_k - len_q) + right``."""
    calls = []
    for d in range(len(starts_q) - 1):
        qd, kd = q[starts_q[d] : starts_q[d + 1]].double(), k[starts_k[d] : starts_k[d + 1]].double()
        qd, kd = qd.transpose(0, 1)[None], kd.transpose(0, 1)[None]
        kd = kd.repeat_interleave(qd.shape[1] // kd.shape[1], dim=1)
        i = torch.arange(qd.shape[2])[:, None] + (kd.shape[2] - qd.shape[2])
        j = torch.arange(kd.shape[2])[None, :]
        allowed = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
        if window[0] >= 0:
            allowed &= j >= i - window[0]
        if window[1] >= 0:
            allowed &= j <= i + window[1]
        calls.append(per_head(qd @ kd.transpose(-1, -2) / math.sqrt(qd.shape[-1]), allowed))
    return torch.stack([c[0] for c in calls]).amax(0), sum(c[1] for c in calls), sum(c[2] for c in calls)


class Varlen(nn.Module):
    """Attends over packed sequences with ``varlen_attn``."""

    def __init__(self, kv_heads: int = HEADS) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(HEADS * DIM, HEADS * DIM), nn.Linear(HEADS * DIM, kv_heads * DIM)
        self.kv_heads = kv_heads
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor, cu_q, cu_k, max_q: int, max_k: int, window=(-1, 0)):
        q = self.q(x).view(x.shape[0], HEADS, DIM)
        k = self.k(y).view(y.shape[0], self.kv_heads, DIM)
        self.seen.append((q, k))
        return varlen_attn(q, k, k, cu_q, cu_k, max_q, max_k, window_size=window, enable_gqa=self.kv_heads != HEADS)


@pytest.mark.parametrize("case", ["causal", "full_gqa", "cross"])
def test_varlen_attention_calls_are_recorded(tmp_path: Path, cpu_varlen: None, case: str) -> None:
    torch.manual_seed(0)
    lengths_q = [5, 11, 1, 7]
    lengths_k = [8, 11, 3, 7] if case == "cross" else lengths_q  # (its queries aligned to the end of its keys)
    window = (-1, -1) if case == "full_gqa" else (-1, 0)
    starts_q, starts_k = ([0, *torch.tensor(n).cumsum(0).tolist()] for n in (lengths_q, lengths_k))
    cu_q = torch.tensor(starts_q, dtype=torch.int32)
    cu_k = cu_q if case != "cross" else torch.tensor(starts_k, dtype=torch.int32)
    model = Varlen(kv_heads=2 if case == "full_gqa" else HEADS)
    x, y = torch.randn(starts_q[-1], HEADS * DIM) * 2, torch.randn(starts_k[-1], HEADS * DIM) * 2
    if case != "cross":
        y = x
    logged_forward(tmp_path, model, lambda: model(x, y, cu_q, cu_k, max(lengths_q), max(lengths_k), window))
    ((q, k),) = model.seen
    check_run(tmp_path, {"root": pooled([varlen_reference(q, k, starts_q, starts_k, window)])})


# -- torchtitan 0.3.0's own Llama 3 --------------------------------------------------------------
@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_torchtitan_debug_llama3_attention_is_recorded(tmp_path: Path, cpu_varlen: None, backend: str) -> None:
    """torchtitan's debug Llama 3 (6 blocks, 16 heads) with its language-model attention:
    compiled ``flex_attention`` with its causal + packed-document block mask, or ``varlen_attn``
    over its documents (in bf16, as it casts them); two documents per row."""
    pytest.importorskip("torchtitan", reason="torchtitan 0.3.0 is installed by scripts/bootstrap (--no-deps)")
    from torchtitan.models.llama3 import _debugmodel

    torch.manual_seed(0)
    model = _debugmodel(backend).build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    inner = {name: m for name, m in model.named_modules() if name.endswith("attention.inner_attention")}
    seen: dict[str, tuple[torch.Tensor, torch.Tensor, float | None]] = {}
    for name, module in inner.items():
        hook = lambda m, args, kwargs, n=name: (seen.setdefault(n, (args[0], args[1], kwargs["scale"])), None)[1]  # noqa: E731
        module.register_forward_pre_hook(hook, with_kwargs=True)
    tokens = torch.randint(2048, (2, 24))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)
    masks = model.get_attention_masks(positions)
    logged_forward(tmp_path, model, lambda: model(tokens, positions, masks))
    document = (positions == 0).cumsum(1)
    same = (document[:, None, :, None] == document[:, None, None, :]) & torch.ones(24, 24, dtype=torch.bool).tril()
    expected = {}
    for name, (q_blnh, k_blnh, scale) in seen.items():
        q, k = q_blnh.transpose(1, 2), k_blnh.transpose(1, 2)
        if backend == "varlen":
            q, k = q.bfloat16(), k.bfloat16()
        q, k = q.double(), k.double().repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
        expected[name] = pooled([per_head(scores, same)])
    assert len(expected) == 6
    check_run(tmp_path, expected)
