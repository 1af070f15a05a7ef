"""A prepacked bf16 linear gives the same numbers as F.linear, at every batch size it meets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine.ops.packed_linear import can_prepack, make_linear


@pytest.mark.parametrize("num_tokens", [1, 7, 32, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_plain_linear_in_bf16(num_tokens: int, with_bias: bool) -> None:
    torch.manual_seed(0)
    weight = torch.randn(96, 64, dtype=torch.bfloat16)  # [out, in]
    bias = torch.randn(96, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(num_tokens, 64, dtype=torch.bfloat16)  # [num_tokens, in]
    got = make_linear(weight, bias)(x)
    want = F.linear(x, weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (num_tokens, 96)
    torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)


def test_fp32_weights_take_the_plain_path() -> None:
    weight = torch.randn(8, 4)
    assert not can_prepack(weight)
    x = torch.randn(3, 4)
    torch.testing.assert_close(make_linear(weight)(x), F.linear(x, weight))
