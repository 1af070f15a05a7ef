"""Rotary position embedding, in the Hugging Face "rotate half" layout.

x_rotated = x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) for the halves x1, x2.
The torch path computes the same products as roll(x) * sin_signed, where roll(x) = cat(x2, x1) and
sin_signed = cat(-sin1, sin2): (-a) * b and a * (-b) are the same float, so the result is bitwise that
of the formula above, with two fewer ops. The C kernel (ops/kernels.c) reads the plain `cos`/`sin` tables.

RoPE scaling (model_config.py) changes only the inverse frequencies and, for YaRN, multiplies cos
and sin by an attention factor; both are folded into the tables, so every path that reads them (the torch
path, the C kernel) rotates with the scaled RoPE. The math is transformers' (modeling_rope_utils.py),
rounding step for rounding step (bit for bit on the published Llama 3.x and Qwen YaRN configs).
"""

from __future__ import annotations

import math

import torch

from services.engine.model_config import RopeScaling, RopeType


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """theta ** -(2i / head_dim) for i < head_dim / 2, then stretched as `scaling` says: [head_dim / 2]."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim  # [head_dim / 2]
    if scaling is None:
        return 1.0 / (theta**exponents)
    if scaling.rope_type == RopeType.LINEAR:  # positions divided by factor: the same as inv_freq / factor
        return 1.0 / (theta**exponents) / scaling.factor
    if scaling.rope_type == RopeType.LLAMA3:
        return _llama3(1.0 / (theta**exponents), scaling)
    return _yarn(theta**exponents, head_dim, theta, scaling)


def attention_factor(scaling: RopeScaling | None) -> float:
    """What cos and sin are multiplied by: YaRN's mscale, 1.0 for every other kind of RoPE."""
    return 1.0 if scaling is None else scaling.attention_factor


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original / low_freq_factor are divided by factor, shorter ones
    than original / high_freq_factor kept, and the band between blended smoothly. [head_dim / 2]."""
    original, low, high = (
        scaling.original_max_position_embeddings,
        scaling.low_freq_factor,
        scaling.high_freq_factor,
    )
    wavelen = 2 * math.pi / inv_freq  # [head_dim / 2]
    is_long = wavelen > original / low
    scaled = torch.where(is_long, inv_freq / scaling.factor, inv_freq)  # [head_dim / 2]
    smooth = (original / wavelen - low) / (high - low)  # [head_dim / 2]
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled  # [head_dim / 2]
    is_medium = ~(wavelen < original / high) & ~is_long
    return torch.where(is_medium, blended, scaled)


def _yarn(pos_freqs: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: interpolate (divide by factor) the dimensions that turn fewer than beta_slow times over the
    original length, keep those that turn more than beta_fast times, and ramp linearly between. [hd / 2]."""

    def dimension(num_rotations: float) -> float:  # the dimension that turns num_rotations times
        turns = scaling.original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return head_dim * math.log(turns) / (2 * math.log(theta))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # [head_dim / 2]: 1 where a dimension is extrapolated (kept as is)
    return (1.0 / (scaling.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def cos_sin_at(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    dtype: torch.dtype,
    factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `RotaryEmbedding.lookup` returns, computed for these positions only (no tables): for models
    whose tables would be large (Gemma 3: head_dim 256, 32k positions, two bases); cos and sin are
    multiplied by `factor` (rope.attention_factor). [num_tokens, 1, hd] x2."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
    half = inv_freq.shape[0]
    signs = torch.cat((-torch.ones(half, device=inv_freq.device), torch.ones(half, device=inv_freq.device)))
    cos, sin = emb.cos() * factor, emb.sin() * factor  # [num_tokens, head_dim] each
    return cos.to(dtype).unsqueeze(1), (sin * signs).to(dtype).unsqueeze(1)


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] -> the same shape, rotated (cos and signed sin from either source)."""
    cos, sin_signed = cos_sin
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class RotaryEmbedding:
    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        device: torch.device | None = None,
        scaling: RopeScaling | None = None,
    ) -> None:
        """Tables built in fp32 on the CPU (the same numbers everywhere), then placed on `device`; scaled
        frequencies and YaRN's attention factor are already in them."""
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)  # [max_positions]
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.half = head_dim // 2
        signs = torch.cat((-torch.ones(self.half), torch.ones(self.half)))  # [head_dim]
        factor = attention_factor(scaling)
        cos, sin = emb.cos() * factor, emb.sin() * factor  # [max_positions, head_dim] each
        self.cos = cos.to(device)  # [max_positions, head_dim]
        self.sin = sin.to(device)  # [max_positions, head_dim]
        self.sin_signed = (sin * signs).to(device)  # [max_positions, head_dim]

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin at each position: two [num_tokens, 1, head_dim] tensors."""
        cos = self.cos[positions].to(dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin_signed[positions].to(dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        return cos, sin

    def rotate(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x: [num_tokens, heads, head_dim] -> the same shape, rotated."""
        return rotate(x, cos_sin)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, kv_heads, head_dim]."""
        return self.rotate(q, cos_sin), self.rotate(k, cos_sin)
