"""Checking the Triton kernels against the float64 `reference_attention` on the device they will run on.

- `self_check`: at load (`engine.attention: auto`, attention_backend.py), two small steps: decode rows at
  block edges beside a chunk over a cached prefix (the paged kernel) and a fresh prompt (SDPA), then
  decode rows over a context of SPLIT_CHECK_BLOCKS blocks, past SPLIT_MIN_BLOCKS and more than one block
  per segment, so split-KV and its reduce run as every decode graph bucket of few rows runs them. A
  kernel that fails there falls back.
- `one_key_ratio`: gpu_check's kernel stage. An absolute tolerance cannot see a mask that drops or adds
  one key at a long context: one key of n moves the output by about 1/n of a value. This measures the
  kernel's error in units of what one key does to each row's output, so the limit is the same at 4k as at
  64 keys (tests/unit/test_triton_one_key.py plants such an error in a copy of the kernels).
"""

from __future__ import annotations

import torch

from services.engine.layers.attention_metadata import RowSpec, build_metadata
from services.engine.ops.reference import reference_attention
from services.engine.ops.triton.dispatch import SPLIT_MIN_BLOCKS
from services.engine.ops.triton.launch import TritonAttention

SPLIT_CHECK_BLOCKS = SPLIT_MIN_BLOCKS + 8  # 40: segments of 3 blocks, the last ones short or empty
# The largest error a kernel may have, as a share of one key's mean effect (exact fp32 kernels: ~3e-5).
ONE_KEY_LIMIT = 0.1


def self_check(attention: TritonAttention, device: torch.device, window: int | None) -> str | None:
    """Run the store and attention kernels on two small random steps (see the module docstring) against
    the float64 reference; None when they agree, else why not. Milliseconds on a GPU; under the
    interpreter, about a second per call for a couple of KV heads."""
    bs = attention.spec.block_size
    long = SPLIT_CHECK_BLOCKS
    steps: dict[str, tuple[list[RowSpec], list[RowSpec]]] = {  # name: (decode rows, prefill rows)
        "mixed": (  # decode rows at block edges, a chunk over a cached prefix, a fresh prompt (SDPA)
            [RowSpec([0], 0, 1), RowSpec([1, 2], bs, 1)],
            [RowSpec([3, 4, 5], bs + 4, bs + 3), RowSpec([6, 7], 0, bs + 3)],
        ),
        "long decode": ([RowSpec(range(5 + long, 5, -1), long * bs - 5, 1), RowSpec([6 + long], 4, 1)], []),
    }  # blocks 0-7 (the long step reads 6 and 7 again), 6-45 backwards and 46
    gen = torch.Generator(device="cpu").manual_seed(0)
    cache = torch.randn((7 + long) * bs, 2, attention.num_kv_heads, attention.spec.head_dim, generator=gen)
    cache = cache.to(attention.spec.dtype).to(device)  # [slots, 2, kv_heads, head_dim]
    for name, (decode, prefill) in steps.items():
        reason = _check_step(attention, cache, decode, prefill, window, gen)
        if reason is not None:
            return f"{reason} in the {name} step"
    return None


def _check_step(
    attention: TritonAttention,
    cache: torch.Tensor,
    decode: list[RowSpec],
    prefill: list[RowSpec],
    window: int | None,
    gen: torch.Generator,
) -> str | None:
    spec = attention.spec
    meta = build_metadata(decode, prefill, spec.block_size, cache.device)
    q = torch.randn(meta.num_tokens, attention.num_heads, spec.head_dim, generator=gen)
    k, v = (torch.randn(meta.num_tokens, attention.num_kv_heads, spec.head_dim, generator=gen) for _ in "kv")
    q, k, v = (t.to(spec.dtype).to(cache.device) for t in (q, k, v))  # [tokens, heads, head_dim]
    try:
        attention.store(cache, meta, k, v)
        got = attention.attend(q, k, v, cache, meta, window=window).double().cpu()
    except Exception as exc:  # a kernel that does not build or launch here: the reason is the answer
        return f"{type(exc).__name__}: {exc}"
    rows = [*decode, *prefill]
    want = reference_attention(q.cpu(), cache.cpu(), rows, spec.block_size, window=window).double()
    error = float((got - want).abs().max())
    tolerance = 1e-3 if spec.dtype == torch.float32 else 3e-2
    return None if error <= tolerance else f"max abs error {error:.3g} against the reference (> {tolerance})"


def one_key_ratio(
    got: torch.Tensor,
    q: torch.Tensor,
    cache: torch.Tensor,
    rows: list[RowSpec],
    block_size: int,
    *,
    window: int | None = None,
) -> float:
    """The kernel's output `got` [num_tokens, num_heads, head_dim] against the float64 reference, in units
    of one key: per row, the largest L2 error of one (token, head) output over the mean L2 change that
    dropping one visible key j makes to it (p_j * ||v_j - o||, to first order); the largest over rows.
    A mask that drops or adds a key errs by about one unit; fp32 rounding by ~1e-4 of one."""
    want = reference_attention(q, cache, rows, block_size, window=window).double()
    error = (got.double() - want).norm(dim=-1)  # [num_tokens, num_heads]
    worst, offset = 0.0, 0
    for row in rows:
        n = row.num_new_tokens
        unit = _one_key_effect(q[offset : offset + n], cache, row, block_size, window)
        if unit > 0.0:  # 0: a row of one visible key, which no key can be dropped from
            worst = max(worst, float(error[offset : offset + n].max()) / unit)
        offset += n
    return worst


def _one_key_effect(
    q: torch.Tensor, cache: torch.Tensor, row: RowSpec, block_size: int, window: int | None
) -> float:
    """The mean over the row's (token, head, visible key) of p_j * ||v_j - o||, in float64."""
    blocks = torch.tensor([max(b, 0) for b in row.block_ids], device=cache.device)  # freed: masked anyway
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=cache.device)).flatten()
    kv = cache[slots[: row.context_len]].double()  # [ctx, 2, kv_heads, head_dim]
    group = q.shape[1] // kv.shape[2]
    k = kv[:, 0].repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
    v = kv[:, 1].repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * q.shape[2] ** -0.5  # [num_heads, q_len, ctx]
    query_pos = torch.arange(row.start_position, row.context_len, device=q.device)[:, None]  # [q_len, 1]
    key_pos = torch.arange(row.context_len, device=q.device)[None, :]  # [1, ctx]
    visible = key_pos <= query_pos  # [q_len, ctx]
    if window is not None:
        visible &= key_pos > query_pos - window
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)  # [num_heads, q_len, ctx]
    out = torch.einsum("hqk,khd->hqd", probs, v)  # [num_heads, q_len, head_dim]
    # ||v_j - o||^2 = ||v_j||^2 - 2 v_j.o + ||o||^2, without the [heads, q_len, ctx, head_dim] difference
    v_dot_o = torch.einsum("hqd,khd->hqk", out, v)  # [num_heads, q_len, ctx]
    dist2 = (v * v).sum(-1).T[:, None, :] - 2 * v_dot_o + (out * out).sum(-1)[..., None]
    effect = probs * dist2.clamp_min(0.0).sqrt()  # [num_heads, q_len, ctx]; 0 where masked
    return float(effect.sum() / (visible.sum() * q.shape[1]))
