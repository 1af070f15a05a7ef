"""Rotary position embedding, in the Hugging Face "rotate half" layout.

x_rotated = x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1) for the halves x1, x2.
The torch path computes the same products as roll(x) * sin_signed, where roll(x) = cat(x2, x1) and
sin_signed = cat(-sin1, sin2): (-a) * b and a * (-b) are the same float, so the result is bitwise that
of the formula above, with two fewer ops. The C kernel (ops/kernels.c) reads the plain `cos`/`sin` tables.
"""

from __future__ import annotations

import torch


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    """theta ** -(2i / head_dim) for i < head_dim / 2: [head_dim / 2]."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def cos_sin_at(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """What `RotaryEmbedding.lookup` returns, computed for these positions only (no tables): for models
    whose tables would be large (Gemma 3: head_dim 256, 32k positions, two bases). [num_tokens, 1, hd] x2."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [num_tokens, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
    half = inv_freq.shape[0]
    signs = torch.cat((-torch.ones(half, device=inv_freq.device), torch.ones(half, device=inv_freq.device)))
    return emb.cos().to(dtype).unsqueeze(1), (emb.sin() * signs).to(dtype).unsqueeze(1)


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim] -> the same shape, rotated (cos and signed sin from either source)."""
    cos, sin_signed = cos_sin
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class RotaryEmbedding:
    def __init__(
        self, head_dim: int, max_positions: int, theta: float, device: torch.device | None = None
    ) -> None:
        """Tables built in fp32 on the CPU (the same numbers everywhere), then placed on `device`."""
        inv_freq = inverse_frequencies(head_dim, theta)
        positions = torch.arange(max_positions, dtype=torch.float32)  # [max_positions]
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.half = head_dim // 2
        signs = torch.cat((-torch.ones(self.half), torch.ones(self.half)))  # [head_dim]
        self.cos = emb.cos().to(device)  # [max_positions, head_dim]
        self.sin = emb.sin().to(device)  # [max_positions, head_dim]
        self.sin_signed = (emb.sin() * signs).to(device)  # [max_positions, head_dim]

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
