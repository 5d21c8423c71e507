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
from collections.abc import Callable, Mapping
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
    with torch.autocast(query.device.type, enabled=False):
        return _statistics(query, key, attn_mask, is_causal, scale, budget)


def _statistics(
    query: Tensor, key: Tensor, attn_mask: Tensor | None, is_causal: bool, scale: float | None, budget: int
) -> tuple[Tensor, Tensor, Tensor]:
    q, k = _by_heads(query), _by_heads(key)
    batch, heads, length, dim = q.shape
    keys = k.shape[-2]
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
    k = k.expand(batch, heads, keys, dim)
    dtype = torch.promote_types(q.dtype, torch.float32)
    keys_t = k.to(dtype).transpose(-1, -2)
    factor = 1.0 / math.sqrt(dim) if scale is None else float(scale)
    mask = None if attn_mask is None else attn_mask.expand(*query.shape[:-1], keys)
    chunk = max(1, budget // max(1, batch * heads * keys * 4 * TEMPORARIES))
    peaks, entropies, counts = [], [], []
    for start in range(0, length, chunk):
        stop = min(length, start + chunk)
        with full_float32_matmul(q.device):  # not TF32: its 10-bit mantissa moves the largest logit by ~1e-3
            logits = torch.matmul(q[:, :, start:stop].to(dtype) * factor, keys_t)
        part = None if mask is None else mask[..., start:stop, :].reshape(-1, heads, stop - start, keys)
        peak, entropy, count = _chunk(logits, part, (start, stop) if is_causal else None)
        peaks.append(peak)
        entropies.append(entropy)
        counts.append(count)
    if len(peaks) == 1:
        return peaks[0], entropies[0], counts[0]
    return torch.stack(peaks).amax(0), torch.stack(entropies).sum(0), torch.stack(counts).sum(0)


def _chunk(logits: Tensor, mask: Tensor | None, causal: tuple[int, int] | None) -> tuple[Tensor, Tensor, Tensor]:
    """Per head: the largest allowed logit, the summed entropy and the count of queries with an
    allowed key, of one chunk of queries (``logits``: ``(N, heads, c, S)``, overwritten)."""
    keys = logits.shape[-1]
    blocked = None  # masked out, as a bool mask
    additive = None
    if mask is not None and mask.dtype == torch.bool:
        blocked = ~mask
    elif mask is not None:
        blocked = masked(mask)
        additive = mask.to(logits.dtype)
    if causal is not None:
        rows = torch.arange(causal[0], causal[1], device=logits.device)[:, None]
        above = rows < torch.arange(keys, device=logits.device)
        blocked = above if blocked is None else blocked | above
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
