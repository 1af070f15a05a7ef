"""Rotary position embedding, in the Hugging Face "rotate half" layout."""

from __future__ import annotations

import torch


class RotaryEmbedding:
    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        positions = torch.arange(max_positions, dtype=torch.float32)  # [max_positions]
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos()  # [max_positions, head_dim]
        self.sin = emb.sin()  # [max_positions, head_dim]
        self.half = head_dim // 2

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].to(dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions].to(dtype).unsqueeze(1)  # [num_tokens, 1, head_dim]
        return cos, sin

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., self.half :], x[..., : self.half]), dim=-1)

    def apply(
        self, q: torch.Tensor, k: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, kv_heads, head_dim]."""
        cos, sin = cos_sin
        return q * cos + self._rotate_half(q) * sin, k * cos + self._rotate_half(k) * sin
