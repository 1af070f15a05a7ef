"""Linear layers whose weights are reordered once for oneDNN, for bf16 matmuls on AVX512-BF16/AMX CPUs.

`F.linear` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout on every call; for the
small batches of a decode step that reorder costs as much as the multiply. A weight reordered at load
time skips it (20-45% faster per call at 1 to 32 rows on a Sapphire Rapids core, docs/performance.md)
and gives bit-identical results. Elsewhere (fp32, CUDA, a torch without oneDNN) `make_linear` returns
plain `F.linear` over the same weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Linear = Callable[[torch.Tensor], torch.Tensor]


def can_prepack(weight: torch.Tensor) -> bool:
    """True where this torch can prepack `weight` for oneDNN's bf16 matmul on this CPU."""
    return (
        weight.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None, *, prepack: bool = True) -> Linear:
    """y = x @ weight.T + bias for x [num_tokens, in_features]; weight [out_features, in_features]."""
    if prepack and can_prepack(weight):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        except RuntimeError:  # an old oneDNN without bf16 support: the plain path still works
            packed = None
        if packed is not None:
            return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return lambda x: F.linear(x, weight, bias)
