"""Attention statistics recomputed on the device from the ``query`` and ``key`` of one attention
call: per head, the largest unmasked logit ``q·kᵀ·scale`` and the entropy of the attention
distribution ``softmax(q·kᵀ·scale + mask)``.

The logits are recomputed in float32 (autocast off: under fp16 autocast an unscaled ``q·kᵀ``
overflows) in chunks of queries, so the extra memory is bounded by a byte budget whatever the
sequence length. Each row of logits is read a fixed few times: its max, then the exponentials
``e = exp(s - max)``, their sum ``Z`` and ``Σ e·log e``, which give the entropy
``log Z - Σ e·log e / Z`` without a softmax or a log-softmax of its own. Every shape is known on the
host, so nothing is read from the device. The matmul is in full float32 whatever
``torch.set_float32_matmul_precision`` allows (TF32 moves the largest logit by ~1e-3). Call under
``torch.no_grad()``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._compat import full_float32_matmul

#: Bytes the temporaries of one chunk of logits may take (their count: :data:`TEMPORARIES`).
BUDGET = 64 << 20
#: Float32 tensors of a chunk's logits' size alive at once: the logits (exponentiated in place)
#: and ``e·log e``; the masks (one byte an element) count as one more.
TEMPORARIES = 3


def masked(mask: Tensor) -> Tensor:
    """Where a float ``mask`` masks a key out: ``-inf``, or at most half its dtype's lowest value
    (``torch.finfo(dtype).min``, which Hugging Face adds for masked keys; it gives them a weight
    of exactly 0, as ``-inf`` does)."""
    return mask <= torch.finfo(mask.dtype).min / 2


def attention_statistics(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    budget: int = BUDGET,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per query head, as ``scaled_dot_product_attention`` would attend: the largest logit over
    batch, queries and unmasked keys (an additive float mask not added); the summed entropy, in
    nats, of the attention distribution of each query that has an unmasked key; and how many
    such queries (times the batch). Three float32 tensors of one value per head.

    Args:
        query: ``(..., heads, L, E)`` (``(N, L, E)`` and ``(L, E)``: one head).
        key: ``(..., heads_k, S, E)``; fewer heads than ``query`` (grouped-query attention):
            each key head serves ``heads // heads_k`` consecutive query heads.
        attn_mask: broadcastable to ``(..., heads, L, S)``: bool (``False``: masked out) or
            float, added to the logits (``-inf`` or ``torch.finfo(dtype).min``: masked out).
        is_causal: query ``i`` sees keys ``j <= i`` (top-left aligned, as SDPA does).
        scale: the logits' factor; default ``1 / sqrt(E)``.
        budget: bytes the temporaries of one chunk of queries may take.
    """
    mask = None if attn_mask is None else attn_mask.expand(*query.shape[:-1], key.shape[-2])
    scores = _sdpa_scores(mask, _by_heads(query).shape[1], is_causal)
    with torch.autocast(query.device.type, enabled=False):
        return _statistics(query, key, scale, budget, scores)


def flex_attention_statistics(
    query: Tensor,
    key: Tensor,
    score_mod: Callable[..., Tensor] | None = None,
    block_mask: Any = None,
    scale: float | None = None,
    budget: int = BUDGET,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`attention_statistics` of a ``torch.nn.attention.flex_attention.flex_attention``
    call: the logits ``q·kᵀ·scale`` passed through ``score_mod(score, b, h, q_idx, kv_idx)``, a
    key seen where ``block_mask`` lists its block (partial or full) and its ``mask_mod`` allows
    it, as the kernel computes them. ``query``: ``(B, heads, L, E)``; ``key``: ``(B, heads_k, S,
    E)`` (grouped-query attention as for SDPA); ``block_mask``: a ``BlockMask`` or ``None``
    (every key)."""

    modded = None if score_mod is None else _over_bhqkv(score_mod, score=True)
    allows = None if block_mask is None else _over_bhqkv(block_mask.mask_mod, score=False)
    listed = None if block_mask is None else block_mask.to_dense().bool()  # (B, heads, query blocks, key blocks)

    def scores(logits: Tensor, start: int, stop: int, first_key: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        batch, heads, _, keys = logits.shape
        b, h, q_idx, kv_idx = (
            torch.arange(*ends, device=logits.device, dtype=torch.int32)  # (as flex_attention gives them)
            for ends in ((batch,), (heads,), (start, stop), (first_key, first_key + keys))
        )
        if modded is not None:
            logits = modded(logits, b, h, q_idx, kv_idx)
        if listed is None or allows is None:
            return logits, None, None
        q_block, kv_block = block_mask.BLOCK_SIZE
        allowed = listed[..., (q_idx // q_block).long(), :][..., (kv_idx // kv_block).long()]
        return logits, ~(allowed & allows(b, h, q_idx, kv_idx)), None

    with torch.autocast(query.device.type, enabled=False):
        return _statistics(query, key, scale, budget, scores, temporaries=TEMPORARIES + 2)


def varlen_attention_statistics(
    query: Tensor,
    key: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor,
    max_k: int,
    is_causal: bool = False,
    scale: float | None = None,
    window_size: Sequence[int] = (-1, -1),
    budget: int = BUDGET,
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`attention_statistics` of a ``torch.nn.attention.varlen.varlen_attn`` call: packed
    sequences, ``query`` ``(T, heads, E)`` and ``key`` ``(T_k, heads_k, E)``, sequence ``d``'s
    queries ``cu_seq_q[d]:cu_seq_q[d + 1]`` seeing its keys ``cu_seq_k[d]:cu_seq_k[d + 1]``
    only, within ``window_size = (left, right)`` of the query's position aligned to the end of
    the keys, as flash attention counts it (``-1``: unlimited; ``is_causal``: ``right = 0``).
    Where the queries and keys share their boundaries (``cu_seq_q is cu_seq_k``, as for
    self-attention), each chunk of queries is compared with the keys within ``max_k`` of it
    only, so the work grows with the tokens times the longest sequence, not the square of the
    tokens."""
    left, right = int(window_size[0]), 0 if is_causal else int(window_size[1])
    bounds_q, bounds_k = cu_seq_q.long(), cu_seq_k.long()

    band = None  # queries and keys in different places: every key
    if cu_seq_k is cu_seq_q:
        band = (max_k - 1 if left < 0 else min(left, max_k - 1), max_k - 1 if right < 0 else min(right, max_k - 1))

    def scores(logits: Tensor, start: int, stop: int, first_key: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        rows = torch.arange(start, stop, device=logits.device)
        cols = torch.arange(first_key, first_key + logits.shape[-1], device=logits.device)
        doc_q = torch.bucketize(rows, bounds_q[1:], right=True).clamp_(max=bounds_q.numel() - 2)
        doc_k = torch.bucketize(cols, bounds_k[1:], right=True).clamp_(max=bounds_k.numel() - 2)
        at_q = rows - bounds_q[doc_q]  # the query's position in its sequence ...
        at = (
            at_q + (bounds_k[doc_q + 1] - bounds_k[doc_q]) - (bounds_q[doc_q + 1] - bounds_q[doc_q])
        )  # ... aligned to the end of its keys
        at_k = (cols - bounds_k[doc_k])[None, :]
        allowed = (doc_q[:, None] == doc_k[None, :]) & (rows < bounds_q[-1])[:, None] & (cols < bounds_k[-1])
        if left >= 0:
            allowed &= at_k >= at[:, None] - left
        if right >= 0:
            allowed &= at_k <= at[:, None] + right
        return logits, ~allowed, None

    with torch.autocast(query.device.type, enabled=False):
        q, k = query.transpose(0, 1).unsqueeze(0), key.transpose(0, 1).unsqueeze(0)
        return _statistics(q, k, scale, budget, scores, band, TEMPORARIES + 1)


#: What a chunk of logits becomes before its statistics: ``(logits, start, stop, first key) ->
#: (scores, masked out or None, added to the scores for the entropy or None)``.
Scores = Callable[[Tensor, int, int, int], tuple[Tensor, Tensor | None, Tensor | None]]


def _statistics(
    query: Tensor,
    key: Tensor,
    scale: float | None,
    budget: int,
    scores: Scores,
    band: tuple[int, int] | None = None,
    temporaries: int = TEMPORARIES,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per head: the largest score, the summed entropy and the count of queries with a key to
    see, of ``query`` against ``key`` as ``scores`` makes each chunk of logits, in chunks of
    queries that ``budget`` bounds. ``band``: the queries ``start:stop`` may see the keys
    ``start - before:stop + after`` only (default: all keys)."""
    q, k = _by_heads(query), _by_heads(key)
    batch, heads, length, dim = q.shape
    keys = k.shape[-2]
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    k = k.expand(batch, heads, keys, dim)
    dtype = torch.promote_types(q.dtype, torch.float32)
    keys_t = k.to(dtype).transpose(-1, -2)
    factor = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    rows = budget // max(1, batch * heads * 4 * temporaries)  # elements of a chunk's logits, per head
    chunk = max(1, rows // max(1, keys))
    if band is not None:  # (a chunk of c queries sees at most c + before + after keys)
        reach = sum(band)
        chunk = max(chunk, math.isqrt(reach * reach + 4 * rows) - reach >> 1)
    peaks, entropies, counts = [], [], []
    for start in range(0, length, chunk):
        stop = min(length, start + chunk)
        first, last = (0, keys) if band is None else (max(0, start - band[0]), min(keys, stop + band[1]))
        with full_float32_matmul(q.device):  # not TF32: its 10-bit mantissa moves the largest logit by ~1e-3
            logits = torch.matmul(q[:, :, start:stop].to(dtype) * factor, keys_t[..., first:last])
        peak, entropy, count = _reduce(*scores(logits, start, stop, first))
        peaks.append(peak)
        entropies.append(entropy)
        counts.append(count)
    if len(peaks) == 1:
        return peaks[0], entropies[0], counts[0]
    return torch.stack(peaks).amax(0), torch.stack(entropies).sum(0), torch.stack(counts).sum(0)


def _sdpa_scores(mask: Tensor | None, heads: int, causal: bool) -> Scores:
    """The logits of an SDPA call masked as it masks them (``mask``: expanded to ``(..., heads, L, S)``)."""

    def scores(logits: Tensor, start: int, stop: int, first_key: int) -> tuple[Tensor, Tensor | None, Tensor | None]:
        keys = logits.shape[-1]
        blocked = None  # masked out, as a bool mask
        additive = None
        part = None if mask is None else mask[..., start:stop, :].reshape(-1, heads, stop - start, keys)
        if part is not None and part.dtype == torch.bool:
            blocked = ~part
        elif part is not None:
            blocked = masked(part)
            additive = part.to(logits.dtype)
        if causal:
            rows = torch.arange(start, stop, device=logits.device)[:, None]
            above = rows < torch.arange(keys, device=logits.device)
            blocked = above if blocked is None else blocked | above
        return logits, blocked, additive

    return scores


def _reduce(logits: Tensor, blocked: Tensor | None, additive: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per head: the largest allowed logit, the summed entropy and the count of queries with an
    allowed key, of one chunk of queries (``logits``: ``(N, heads, c, S)``, overwritten;
    ``blocked``: where a key is masked out; ``additive``: added for the entropy only)."""
    scores = logits if blocked is None else logits.masked_fill_(blocked, -math.inf)
    top = scores.amax(-1, keepdim=True)  # per query: its largest allowed logit ...
    if additive is not None:
        scores = scores.add_(additive)  # (keys masked out stay at -inf)
        top_scores = scores.amax(-1, keepdim=True)  # ... and, with a float mask added, its largest score
    else:
        top_scores = top
    seen = top_scores > -math.inf  # queries with an allowed key
    e = scores.sub_(top_scores.where(seen, 0.0)).exp_()
    z = e.sum(-1, keepdim=True)
    entropy = (z.log() + torch.special.entr(e).sum(-1, keepdim=True) / z).where(seen, 0.0)
    return top.amax(dim=(0, 2, 3)), entropy.sum(dim=(0, 2, 3)), seen.sum(dim=(0, 2, 3), dtype=logits.dtype)


def _over_bhqkv(mod: Callable[..., Tensor], *, score: bool) -> Callable[..., Tensor]:
    """``mod``, a flex attention ``score_mod(score, b, h, q_idx, kv_idx)`` (or ``mask_mod``
    without the score), applied to every ``(b, h, q_idx, kv_idx)`` at once: ``torch.vmap`` over
    the index vectors (and the score's matching dimension), innermost first."""
    fn = mod
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        fn = torch.vmap(fn, in_dims=((0,) if score else ()) + dims)
    return fn


def _by_heads(t: Tensor) -> Tensor:
    """``t`` as ``(batch, heads, length, dim)``: leading dims before the heads' flattened."""
    if t.dim() < 3:
        return t.reshape(1, 1, *t.shape[-2:])
    if t.dim() == 3:
        return t.unsqueeze(1)
    return t.reshape(-1, *t.shape[-3:])


def sdpa_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``attention_statistics`` arguments of a ``scaled_dot_product_attention(query, key, value,
    attn_mask, dropout_p, is_causal, scale, enable_gqa)`` call (GQA needs no flag here)."""
    bound = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args))
    bound.update(kwargs)
    return {name: bound.get(name, default) for name, default in _SDPA_DEFAULTS.items()}


_SDPA_DEFAULTS: dict[str, Any] = {"query": None, "key": None, "attn_mask": None, "is_causal": False, "scale": None}


def flex_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """``flex_attention_statistics`` arguments of a ``flex_attention(query, key, value,
    score_mod, block_mask, scale, enable_gqa, ...)`` call, from its bound arguments (GQA needs no
    flag here)."""
    return {name: arguments.get(name) for name in ("query", "key", "score_mod", "block_mask", "scale")}


_VARLEN_NAMES = ("query", "key", "value", "cu_seq_q", "cu_seq_k", "max_q", "max_k", "is_causal", "scale", "window_size")


def varlen_arguments(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """``varlen_attention_statistics`` arguments of a call of the op ``varlen_attn`` calls
    (``torch_attn::_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal,
    scale, window_size, enable_gqa, seqused_k, block_table, num_splits)``); ``None`` for a paged
    key cache (``block_table``, ``seqused_k``: inference only), whose keys are not packed."""
    bound = dict(zip((*_VARLEN_NAMES, "enable_gqa", "seqused_k", "block_table"), args))
    bound.update(kwargs)
    if bound.get("cu_seq_k") is None or bound.get("block_table") is not None or bound.get("seqused_k") is not None:
        return None
    found = {name: bound.get(name) for name in _VARLEN_NAMES if name not in ("value", "max_q")}
    found["is_causal"] = bool(found["is_causal"])
    found["window_size"] = (-1, -1) if found["window_size"] is None else tuple(found["window_size"])
    return found


def mha_arguments(func: Callable[..., Any], args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``attention_statistics`` arguments of a ``F.multi_head_attention_forward`` call: its
    queries and keys projected and split into heads as that function does (biases added to the
    keys, a zero key appended), ``key_padding_mask`` and ``attn_mask`` merged into one additive
    mask. Covers the path that calls ``scaled_dot_product_attention`` (``need_weights=False``)
    and the one that computes the softmax itself (``need_weights=True``) alike."""
    a = inspect.signature(func).bind(*args, **kwargs).arguments
    query, key, heads = a["query"], a["key"], a["num_heads"]
    padding, mask = a.get("key_padding_mask"), a.get("attn_mask")
    if query.dim() == 2:  # unbatched
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        padding = None if padding is None else padding.unsqueeze(0)
    length, batch, width = query.shape
    dim = width // heads
    if a.get("use_separate_proj_weight", False):
        weights = (a["q_proj_weight"], a["k_proj_weight"])
    else:
        weights = tuple(a["in_proj_weight"].chunk(3)[:2])
    bias = a.get("in_proj_bias")
    biases = (None, None) if bias is None else tuple(bias.chunk(3)[:2])
    q = F.linear(query, weights[0], biases[0]).reshape(length, batch, heads, dim).permute(1, 2, 0, 3)
    static = a.get("static_k")
    if static is not None:
        k = static.reshape(batch, heads, -1, dim)
    else:
        k = F.linear(key, weights[1], biases[1])
        if a.get("bias_k") is not None:
            k = torch.cat([k, a["bias_k"].repeat(1, batch, 1)])
        k = k.reshape(k.shape[0], batch, heads, dim).permute(1, 2, 0, 3)
    if a.get("add_zero_attn", False):
        k = torch.cat([k, k.new_zeros(batch, heads, 1, dim)], dim=2)
    extra = k.shape[2] - key.shape[0] if static is None else 0  # keys appended: never masked
    additive = None
    if mask is not None:
        mask = _additive(mask, q.dtype)
        mask = mask.reshape(batch, heads, length, -1) if mask.dim() == 3 else mask
        additive = F.pad(mask, (0, extra)) if extra else mask
    if padding is not None:
        pad = _additive(padding, q.dtype).reshape(batch, 1, 1, -1)
        pad = F.pad(pad, (0, extra)) if extra else pad
        additive = pad if additive is None else additive + pad
    return {"query": q, "key": k, "attn_mask": additive, "is_causal": False, "scale": None}


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """An ``nn.MultiheadAttention`` mask as an additive float mask (a bool ``True`` is masked out)."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, -math.inf)
    return mask.to(dtype)
