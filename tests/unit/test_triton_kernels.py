"""The Triton kernels (services/engine/ops/triton) run under Triton's interpreter on CPU tensors (conftest.py
turns it on) against `reference_attention`, a float64 per-row loop that shares no code with them:
fp32 within 1e-4, bf16 and fp16 within 2e-2. Cases stay small: the interpreter costs milliseconds per
block step and program.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.engine.layers.attention_backend import TorchAttention, checked_or_torch
from services.engine.layers.attention_metadata import AttentionMetadata, RowSpec, build_metadata
from services.engine.layers.triton_self_check import self_check
from services.engine.model_config import ModelConfig
from services.engine.ops.reference import reference_attention
from services.engine.ops.triton import kernels
from services.engine.ops.triton.dispatch import GQA_RATIOS, KernelSpec
from services.engine.ops.triton.launch import TritonAttention, _StepLayout

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


def test_the_kernels_run_interpreted() -> None:
    assert kernels.INTERPRETED and kernels.LIBRARY_INTERPRETED, "conftest.py sets TRITON_INTERPRET=1"


class Step:
    """A step of rows (context_len, num_new_tokens) over a cache of randomly scattered blocks, with
    random K/V everywhere (stale values past each context) and this step's new K/V stored by the kernel."""

    def __init__(
        self,
        rows: list[tuple[int, int]],
        *,
        dtype: torch.dtype = torch.float32,
        head_dim: int = 64,
        kv_heads: int = 2,
        ratio: int = 2,
        block_size: int = 16,
        split: bool | None = False,
        seed: int = 0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_blocks = sum(-(-ctx // block_size) for ctx, _ in rows) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()  # blocks scattered over the cache
        specs, taken = [], 0
        for ctx, new in rows:
            n = -(-ctx // block_size)
            specs.append(RowSpec(order[taken : taken + n], ctx - new, new))
            taken += n
        self.decode = [s for s in specs if s.num_new_tokens == 1]
        self.prefill = [s for s in specs if s.num_new_tokens != 1]
        self.block_size = block_size
        self.meta = build_metadata(self.decode, self.prefill, block_size)
        self.cache = torch.randn(num_blocks * block_size, 2, kv_heads, head_dim, generator=gen).to(dtype)
        tokens = self.meta.num_tokens
        self.q = torch.randn(tokens, kv_heads * ratio, head_dim, generator=gen).to(dtype)
        self.k = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
        self.v = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype)
        self.attention = TritonAttention(
            KernelSpec(dtype, head_dim, block_size), kv_heads * ratio, kv_heads, split=split
        )
        self.attention.store(self.cache, self.meta, self.k, self.v)

    def run(self, window: int | None = None, scale: float | None = None) -> torch.Tensor:
        return self.attention.attend(
            self.q, self.k, self.v, self.cache, self.meta, window=window, scale=scale
        )

    def reference(self, window: int | None = None, scale: float | None = None) -> torch.Tensor:
        rows = [r for r in (*self.decode, *self.prefill) if r.num_new_tokens]
        return reference_attention(self.q, self.cache, rows, self.block_size, window=window, scale=scale)


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.double() - want.double()).abs().max().item()


def test_the_store_writes_each_token_through_its_slot_and_skips_padding() -> None:
    step = Step([(20, 20), (9, 1)])
    cache = torch.zeros_like(step.cache)
    meta = step.meta
    padded = AttentionMetadata(
        meta.decode_rows, meta.prefill_rows, meta.block_size, meta.slot_mapping.clone(), meta.positions,
        meta.token_rows, meta.block_tables, meta.max_context_len,
    )  # fmt: skip
    padded.slot_mapping[3] = -1  # a padded token: nothing may be written for it
    step.attention.store(cache, padded, step.k, step.v)
    want = torch.zeros_like(cache)
    keep = padded.slot_mapping >= 0
    want.index_copy_(0, padded.slot_mapping[keep], torch.stack((step.k, step.v), 1)[keep])
    assert torch.equal(cache, want)
    assert cache.abs().sum() > 0


@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_rows_at_block_edges(block_size: int) -> None:
    lengths = [1, block_size - 1, block_size, block_size + 1]
    step = Step([(n, 1) for n in lengths], block_size=block_size)
    assert max_error(step.run(), step.reference()) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_prefill_over_a_cached_prefix_mixed_with_decode(dtype: torch.dtype) -> None:
    # decode rows; a fresh prompt; a chunk whose first 24 positions are cached; one of 17 over 16 cached
    step = Step([(5, 1), (40, 1), (20, 20), (33, 9), (33, 17)], dtype=dtype)
    assert max_error(step.run(), step.reference()) <= TOLERANCE[dtype]


@pytest.mark.parametrize("ratio", GQA_RATIOS)
def test_every_gqa_ratio(ratio: int) -> None:
    step = Step([(18, 1), (21, 5)], kv_heads=2, ratio=ratio)
    assert max_error(step.run(), step.reference()) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("head_dim", [128, 256])
def test_wider_heads_in_bf16(head_dim: int) -> None:
    step = Step([(17, 1), (19, 3)], dtype=torch.bfloat16, head_dim=head_dim, kv_heads=1, ratio=4)
    assert max_error(step.run(), step.reference()) <= TOLERANCE[torch.bfloat16]


@pytest.mark.parametrize("split", [False, True])
def test_a_sliding_window_skips_keys_behind_it(split: bool) -> None:
    rows = [(40, 1), (70, 1)] if split else [(40, 1), (50, 12), (9, 9)]
    step = Step(rows, split=split)
    got = step.run(window=8, scale=0.3)
    assert max_error(got, step.reference(window=8, scale=0.3)) <= TOLERANCE[torch.float32]
    assert max_error(got, step.reference(scale=0.3)) > 1e-2, "the window must change the output"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_kv_decode_with_a_prefill_row_beside_it(dtype: torch.dtype) -> None:
    step = Step([(3, 1), (70, 1), (130, 1), (20, 6)], dtype=dtype, split=True)
    assert step.attention._layout(step.meta).split_decode
    assert max_error(step.run(), step.reference()) <= TOLERANCE[dtype]


def test_padded_rows_are_skipped_and_leave_the_others_alone() -> None:
    """A row with no new tokens (unified kernel) and a decode row with no context (split-KV, as a
    CUDA-graph bucket pads them) write nothing, and the real rows still get their attention."""
    step = Step([(9, 1), (30, 0), (20, 4)])
    assert max_error(step.run(), step.reference()) <= TOLERANCE[torch.float32]
    split = Step([(9, 1), (40, 1), (12, 1)], split=True)
    layout = split.attention._layout(split.meta)
    seq_lens = layout.seq_lens.clone()
    seq_lens[1] = 0  # row 1 is padding now
    split.meta.backend_state[split.attention] = _StepLayout(layout.query_start, seq_lens, 3, True)
    got = split.run()
    want = split.reference()
    assert max_error(got[[0, 2]], want[[0, 2]]) <= TOLERANCE[torch.float32]
    assert torch.equal(got[1], torch.zeros_like(got[1]))


class _WrongScale(TritonAttention):
    def attend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return super().attend(*args, **(kwargs | {"scale": 0.01}))


class _NoLaunch(TritonAttention):
    def store(self, *args: Any) -> None:
        raise RuntimeError("no kernel image is available for execution on the device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_load_time_self_check_passes_good_kernels_and_auto_falls_back_from_bad(
    dtype: torch.dtype,
) -> None:
    """`engine.attention: auto` on a GPU keeps Triton only if one small step agrees with the reference."""
    cpu = torch.device("cpu")
    config = ModelConfig.from_dict({
        "architectures": ["Gemma3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "sliding_window": 8, "sliding_window_pattern": 2,
    })  # fmt: skip
    spec = KernelSpec(dtype, 64, 16)
    good = TritonAttention(spec, 4, 2)
    assert self_check(good, cpu, None) is None and self_check(good, cpu, 8) is None
    assert checked_or_torch(good, config, cpu) is good
    wrong = _WrongScale(spec, 4, 2)
    assert "against the reference" in (self_check(wrong, cpu, None) or "")
    assert isinstance(checked_or_torch(wrong, config, cpu), TorchAttention)
    broken = _NoLaunch(spec, 4, 2)
    assert (self_check(broken, cpu, None) or "").startswith("RuntimeError: no kernel image")
    assert isinstance(checked_or_torch(broken, config, cpu), TorchAttention)


class _HalfReduce:
    """The reduce kernel told there are half as many segments: it merges the wrong partials, a fault only
    split-KV decode has (every decode graph bucket of few rows takes it)."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, NUM_SEGMENTS: int, **kwargs: Any) -> None:
            self.real[grid](*args, NUM_SEGMENTS=NUM_SEGMENTS // 2, **kwargs)

        return launch


@pytest.mark.parametrize("window", [None, 8])
def test_the_self_check_runs_split_kv_decode_over_more_blocks_than_segments(
    window: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cpu = torch.device("cpu")
    attention = TritonAttention(KernelSpec(torch.float32, 64, 16), 4, 2)
    monkeypatch.setattr(kernels, "reduce_segments_kernel", _HalfReduce(kernels.reduce_segments_kernel))
    reason = self_check(attention, cpu, window) or ""
    assert "against the reference" in reason and reason.endswith("in the long decode step")
