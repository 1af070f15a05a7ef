"""A prompt with no cached prefix attends through torch's SDPA over its own new K/V (flash attention on a
GPU), one call per such row; decode rows and chunks over a cached prefix keep the Triton kernels, and so
does a fresh prompt longer than its layer's sliding window (flash SDPA has no window). Every case is
checked against `reference_attention`, which reads only the cache, with the tolerances of
test_triton_kernels.py, and spies on SDPA and on the paged kernel to see which rows took which path."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.engine.ops.triton import kernels, launch
from tests.unit.test_triton_kernels import TOLERANCE, Step, max_error
from tests.unit.test_triton_specialization import LaunchSpy


class SdpaSpy:
    """Stands in for launch.py's SDPA: records each call's query length and keyword arguments."""

    def __init__(self) -> None:
        self.real = launch.scaled_dot_product_attention
        self.calls: list[tuple[int, dict[str, Any]]] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        self.calls.append((q.shape[2], kwargs))  # q: [1, num_heads, num_tokens, head_dim]
        return self.real(q, k, v, **kwargs)


def spied(monkeypatch: pytest.MonkeyPatch) -> tuple[SdpaSpy, LaunchSpy]:
    sdpa = SdpaSpy()
    paged = LaunchSpy(kernels.paged_attention_kernel, launch=True)
    monkeypatch.setattr(launch, "scaled_dot_product_attention", sdpa)
    monkeypatch.setattr(kernels, "paged_attention_kernel", paged)
    return sdpa, paged


def paged_rows(paged: LaunchSpy) -> int:
    """Rows the paged kernel was given, over all its launches (`num_rows` is its ninth argument)."""
    return sum(args[8] for args, _ in paged.calls)


@pytest.mark.parametrize(
    ("dtype", "ratio", "scale", "split"),
    [
        (torch.float32, 1, None, False),
        (torch.float32, 4, 0.3, True),  # GQA, Gemma's custom scale, decode rows through split-KV
        (torch.bfloat16, 2, 0.0625, False),
    ],
)
def test_fresh_prompts_take_sdpa_beside_decode_rows_and_a_cached_prefix(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, ratio: int, scale: float | None, split: bool
) -> None:
    sdpa, paged = spied(monkeypatch)
    # decode rows; a fresh prompt of 20; a chunk of 9 over 24 cached positions; a fresh prompt of 5
    step = Step([(5, 1), (40, 1), (20, 20), (33, 9), (5, 5)], dtype=dtype, ratio=ratio, split=split)
    got = step.run(scale=scale)
    assert max_error(got, step.reference(scale=scale)) <= TOLERANCE[dtype]
    assert [n for n, _ in sdpa.calls] == [20, 5]
    expected_scale = 64**-0.5 if scale is None else scale
    assert all(kw["is_causal"] and kw["scale"] == expected_scale for _, kw in sdpa.calls)
    assert paged_rows(paged) == (1 if split else 3), "the fresh prompts must not reach the paged kernel"


def test_a_window_no_shorter_than_the_prompt_masks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    sdpa, paged = spied(monkeypatch)
    step = Step([(9, 1), (6, 6), (20, 20)])  # with a window of 8: the 6-token prompt fits, the 20 does not
    got = step.run(window=8)
    assert max_error(got, step.reference(window=8)) <= TOLERANCE[torch.float32]
    assert max_error(got[7:], step.reference()[7:]) > 1e-2, "the window must change the long prompt's output"
    assert [n for n, _ in sdpa.calls] == [6]
    assert paged_rows(paged) == 2  # the decode row, then the 20-token prompt in a run of its own


def test_a_decode_only_step_never_calls_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a CUDA graph captures: decode rows only, so the per-row SDPA loop is never in a graph."""
    sdpa, paged = spied(monkeypatch)
    step = Step([(9, 1), (1, 1), (33, 1)])
    assert max_error(step.run(), step.reference()) <= TOLERANCE[torch.float32]
    assert sdpa.calls == [] and paged_rows(paged) == 3
