"""Attention over the paged KV cache: the batched torch path and the C decode kernel's entry.

Two fast paths read a step's metadata (attention_metadata.py). Small steps go to the C kernel
(`ops.cpu.CpuKernels.paged_attention`), which reads the cache through `block_tables` per token. Large steps
take `paged_attention` below: each group (decode rows, prefill rows) is attended in one batched SDPA call
over a padded gather of its context, or, for a lone fresh prompt, over the new K/V directly with
`is_causal`. No per-sequence Python loop runs per layer. `ops.reference.reference_attention` shares no code
with either.

Sliding-window layers pass `window`: each query then sees only its last `window` keys, itself included
(key position > query position - window, as transformers' sliding-window mask). The gathers still span
the whole context and mask the rest, so a block id the KV manager has freed below every window (stored
as `NO_BLOCK`) is read as block 0 and never weighed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from services.engine.layers.attention_metadata import AttentionMetadata, GroupMetadata

if TYPE_CHECKING:
    from services.engine.ops.cpu import CpuKernels


def write_kv(cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store new K/V. cache: [num_slots, 2, num_kv_heads, head_dim]; k, v: [num_tokens, kv_heads, hd]."""
    kv = torch.stack((k, v), dim=1).to(cache.dtype)  # [num_tokens, 2, kv_heads, hd]
    cache.index_copy_(0, slot_mapping, kv)


# (q of the decode rows [num_decode, num_heads, head_dim], cache, meta, window) -> the same shape as q
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, "AttentionMetadata", int | None], torch.Tensor]


def kernel_decode_attention(
    kernels: CpuKernels | None, meta: AttentionMetadata, scale: float | None = None
) -> DecodeAttention | None:
    """The C kernel for this step's decode rows, reading the (fp32 or fp16) cache in place; None where it does
    not run (no kernels, or no decode rows). Family-neutral: it only attends."""
    num_decode = meta.num_decode_tokens
    if kernels is None or not num_decode:
        return None
    token_rows = meta.token_rows[:num_decode]  # [num_decode]
    positions = meta.positions[:num_decode]  # [num_decode]

    def attend(
        q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, window: int | None
    ) -> torch.Tensor:
        q2 = q.reshape(num_decode, -1).float()  # [num_decode, num_heads * head_dim]
        out = torch.empty_like(q2)  # [num_decode, num_heads * head_dim]
        kernels.paged_attention(
            q2,
            out,
            cache,
            meta.block_tables,
            token_rows,
            positions,
            meta.block_size,
            window=window,
            scale=scale,
        )
        return out.view(q.shape).to(q.dtype)  # [num_decode, num_heads, head_dim]

    return attend


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    decode_attention: DecodeAttention | None = None,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k, v: this step's [num_tokens, kv_heads, head_dim], already
    written to the cache. Returns [num_tokens, num_heads, head_dim]. The cache may hold another dtype than
    q (fp32 KV under bf16 compute, fp16 KV under fp32: engine.kv_cache_dtype); the gathered groups are
    attended in the wider of the two, and a fresh prompt attends its k, v as the cache holds them.
    `decode_attention`, when given, takes the decode rows (the C kernel reads the cache in place).
    `window`: a sliding-window layer's window; `scale`: the score scale (default head_dim ** -0.5)."""
    if meta.is_fresh_prompt:  # 4-D inputs: the 3-D form falls back to SDPA's slow math kernel
        k, v = _as_stored(k, cache), _as_stored(v, cache)
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, num_tokens, hd]
        mask = None if window is None else meta.fresh_prompt_mask(window)
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
    num_decode = meta.num_decode_tokens
    decode = meta.group(is_decode=True, window=window)
    if decode is not None and decode_attention is not None:
        out[:num_decode] = decode_attention(q[:num_decode], cache, meta, window)
    elif decode is not None:
        q_d = q[:num_decode].unsqueeze(2)  # [num_rows, num_heads, 1, head_dim]
        out[:num_decode] = _attend(q_d, cache, decode, scale).squeeze(2)
    prefill = meta.group(is_decode=False, window=window)
    if prefill is not None:
        if prefill.query_index is None or prefill.query_valid is None:
            raise ValueError("prefill group metadata lacks its query layout")
        q_p = q[num_decode:][prefill.query_index].transpose(1, 2)  # [num_rows, num_heads, max_q, head_dim]
        o_p = _attend(q_p, cache, prefill, scale).transpose(1, 2)  # [num_rows, max_q, num_heads, head_dim]
        out[num_decode:] = o_p[prefill.query_valid]  # [num_prefill_tokens, num_heads, head_dim]
    return out


def _as_stored(t: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """t as the cache holds it, in t's dtype: rounded through a narrower cache (fp16 KV), so a fresh prompt
    sees the same keys and values as every later step that reads them back (fp32 holds all exactly)."""
    if cache.dtype in (t.dtype, torch.float32):
        return t
    return t.to(cache.dtype).to(t.dtype)


def _attend(q: torch.Tensor, cache: torch.Tensor, group: GroupMetadata, scale: float | None) -> torch.Tensor:
    num_rows, max_ctx = group.gather_slots.shape
    _, _, num_kv_heads, head_dim = cache.shape
    kv = cache.index_select(0, group.gather_slots.view(-1))  # [num_rows * max_ctx, 2, kv_heads, hd]
    kv = kv.view(num_rows, max_ctx, 2, num_kv_heads, head_dim)
    k = kv[:, :, 0].transpose(1, 2)  # [num_rows, kv_heads, max_ctx, head_dim]
    v = kv[:, :, 1].transpose(1, 2)  # [num_rows, kv_heads, max_ctx, head_dim]
    wide = torch.promote_types(q.dtype, cache.dtype)  # fp32 for bf16 q over fp32 KV, fp32 q over fp16 KV
    out = F.scaled_dot_product_attention(
        q.to(wide), k.to(wide), v.to(wide), attn_mask=group.mask, scale=scale, enable_gqa=True
    )
    return out.to(q.dtype)
