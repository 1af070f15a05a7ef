"""The slow reference twins of every fast path, written for clarity and sharing no code with them. Tests
compare each pair.

- the C kernels of kernels.c: `rms_norm`, `linear`, `silu_mul`, `rope`;
- paged attention (layers/attention.py's SDPA path and the C and Triton kernels): `reference_attention`,
  a per-row float64 loop over blocks copied out of the cache;
- the counter RNG (ops/counter_rng.py): `reference_bits`, `reference_uniform`, `reference_exponential`,
  in plain Python integers;
- the sampler (layers/sampler.py): `reference_sample_probs` and `reference_sample_token`, plain Python
  loops and sorting over one row; torch only for the row's storage (float32, so element values round like
  the fast path's) and for softmax. Seeded rows draw their noise from the pure-Python counter hash above.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from services.common.sampling import SamplingParams
from services.engine.ops.counter_rng import GAMMA, MASK64, NUM_UNIFORM_BITS, derive_seed, splitmix64
from services.engine.scheduling.block_pool import NO_BLOCK

if TYPE_CHECKING:
    from services.engine.layers.attention_metadata import RowSpec


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, K], weight [K] -> [M, K], in float64 then back to x's dtype."""
    x64 = x.double()
    inv = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)  # [M, 1]
    return (x64 * inv * weight.double()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T in float64, returned as float32 [M, N]; weight may be bf16."""
    return F.linear(x.double(), weight.double()).float()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [M, 2 * I] -> silu(gate) * up [M, I]."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    return (F.silu(gate) * up).float()


def rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [M, heads, head_dim] rotated at positions [M] with tables [max_positions, head_dim]."""
    half = x.shape[-1] // 2
    c = cos[positions].unsqueeze(1)  # [M, 1, head_dim]
    s = sin[positions].unsqueeze(1)  # [M, 1, head_dim]
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [M, heads, head_dim]
    return x * c + rotated * s


def reference_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    rows: Sequence[RowSpec],
    block_size: int,
    *,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Slow, plain path: per row, copy its blocks into dense K/V, then float64 softmax attention.

    q: [num_tokens, num_heads, head_dim] in the flat order of `rows`. Shares no code with the fast paths.
    With `window`, a query sees keys at positions > its own - window only.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    outputs = []
    offset = 0
    for row in rows:
        blocks = [
            cache[b * block_size : (b + 1) * block_size] if b != NO_BLOCK else cache[:block_size] * 0
            for b in row.block_ids
        ]  # a freed block's keys lie outside every window: any finite values do
        dense = torch.cat(blocks)[: row.context_len].double()  # [ctx, 2, kv_heads, head_dim]
        group_size = num_heads // dense.shape[2]
        k = dense[:, 0].repeat_interleave(group_size, dim=1)  # [ctx, num_heads, head_dim]
        v = dense[:, 1].repeat_interleave(group_size, dim=1)  # [ctx, num_heads, head_dim]
        q_row = q[offset : offset + row.num_new_tokens].double()  # [q_len, num_heads, head_dim]
        factor = head_dim**-0.5 if scale is None else scale
        scores = torch.einsum("qhd,khd->hqk", q_row, k) * factor  # [num_heads, q_len, ctx]
        query_pos = torch.arange(row.start_position, row.context_len, device=q.device)[:, None]  # [q_len, 1]
        key_pos = torch.arange(row.context_len, device=q.device)[None, :]  # [1, ctx]
        allowed = key_pos <= query_pos  # [q_len, ctx]
        if window is not None:
            allowed &= key_pos > query_pos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        outputs.append(torch.einsum("hqk,khd->qhd", probs, v))  # [q_len, num_heads, head_dim]
        offset += row.num_new_tokens
    return torch.cat(outputs).to(q.dtype)  # [num_tokens, num_heads, head_dim]


def reference_bits(key: int, token_id: int) -> int:
    """The 64 random bits (unsigned) for `token_id` under `key`, in plain Python ints."""
    return splitmix64((key + token_id * GAMMA) & MASK64)


def reference_uniform(key: int, token_id: int) -> float:
    """The uniform in (0, 1) for `token_id` under `key`; exact in float64."""
    return ((reference_bits(key, token_id) >> 12) + 0.5) / (1 << NUM_UNIFORM_BITS)


def reference_exponential(key: int, token_id: int) -> float:
    """The Exp(1) draw for `token_id` under `key`, as a Python float (float32 comes from the caller)."""
    return -math.log(reference_uniform(key, token_id))


def reference_sample_probs(
    logits_row: Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    banned_token_ids: Sequence[int] = (),
    allowed_token_ids: Collection[int] | None = None,
) -> Tensor:
    """The probability vector [vocab_size] one row samples from; one-hot at the argmax when greedy.
    `allowed_token_ids`: a grammar's next tokens (None: no grammar)."""
    row = logits_row.detach().to(dtype=torch.float32, device="cpu").clone()  # [vocab_size]
    for token_id in set(prompt_ids) | set(output_ids):
        value = float(row[token_id])
        penalty = params.repetition_penalty
        row[token_id] = value / penalty if value > 0 else value * penalty
    for token_id in set(output_ids):
        count = output_ids.count(token_id)
        row[token_id] = float(row[token_id]) - params.frequency_penalty * count - params.presence_penalty
    for token_id in banned_token_ids:
        row[token_id] = -math.inf
    if allowed_token_ids is not None:
        for token_id in range(len(row)):
            if token_id not in allowed_token_ids:
                row[token_id] = -math.inf
    values = row.tolist()
    if params.is_greedy:
        probs = torch.zeros_like(row)  # [vocab_size]
        probs[values.index(max(values))] = 1.0
        return probs
    row = row / params.temperature  # [vocab_size]
    keep = [True] * len(values)
    if params.top_k > 0:
        _keep_top_k(row.tolist(), params.top_k, keep)
    if params.top_p < 1.0:
        _keep_top_p(_masked_softmax(row, keep), params.top_p, keep)
    if params.min_p > 0.0:
        probs_list = _masked_softmax(row, keep)
        threshold = max(probs_list) * params.min_p
        for token_id, prob in enumerate(probs_list):
            if prob < threshold:
                keep[token_id] = False
    return torch.tensor(_masked_softmax(row, keep), dtype=torch.float32)  # [vocab_size]


def reference_sample_token(
    logits_row: Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    banned_token_ids: Sequence[int] = (),
    allowed_token_ids: Collection[int] | None = None,
) -> int:
    """The token a greedy or seeded row picks: argmax(probs / q), q[v] the counter draw for v.

    Unseeded sampled rows draw from the engine's generator, which has no reference: ValueError.
    """
    probs = reference_sample_probs(
        logits_row, params, prompt_ids, output_ids, banned_token_ids, allowed_token_ids
    )
    if params.is_greedy:
        return int(probs.argmax())
    if params.seed is None:
        raise ValueError("an unseeded sampled row has no reference token")
    key = derive_seed(params.seed, len(output_ids))
    q = torch.tensor(
        [reference_exponential(key, token_id) for token_id in range(len(probs))], dtype=torch.float32
    )  # [vocab_size]
    return int((probs / q).argmax())


def _masked_softmax(row: Tensor, keep: list[bool]) -> list[float]:
    """Softmax over the kept entries of `row`; dropped entries get 0."""
    masked = row.clone()  # [vocab_size]
    for token_id, is_kept in enumerate(keep):
        if not is_kept:
            masked[token_id] = -math.inf
    return masked.softmax(dim=0).tolist()


def _keep_top_k(values: list[float], top_k: int, keep: list[bool]) -> None:
    """Drop every value below the k-th largest (ties with it stay)."""
    if top_k >= len(values):
        return
    kth_value = sorted(values, reverse=True)[top_k - 1]
    for token_id, value in enumerate(values):
        if value < kth_value:
            keep[token_id] = False


def _keep_top_p(probs: list[float], top_p: float, keep: list[bool]) -> None:
    """Walk tokens from most to least likely; drop each one reached after the mass hits top_p."""
    mass_before = 0.0
    for rank, token_id in enumerate(sorted(range(len(probs)), key=lambda i: -probs[i])):
        if rank > 0 and mass_before >= top_p:
            keep[token_id] = False
        mass_before += probs[token_id]
