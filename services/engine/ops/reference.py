"""Slow torch twins of the C kernels in kernels.c, written for clarity. Tests compare the two.

The attention twin is `services.engine.attention.reference_attention`, which shares no code with either
fast path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
