"""Launching the Triton kernels for one step: the `triton` attention backend of attention_backend.py.

One `TritonAttention` serves one model: its specialization (dispatch.py) was chosen at load. Per layer,
`store` writes the step's K/V through the slot mapping and `attend` runs the paged kernel over every
row; decode rows go through split-KV instead when there are few of them over long contexts (the 2-D
grid would leave most SMs idle), and a prompt with no cached prefix goes through torch's SDPA (flash
attention on a GPU) over its own new K/V, one call per such row. What the kernels read beyond the step's
metadata (the query layout and context lengths as int32, the fresh prompts' rows as host ints) is built
once per step and kept on the metadata.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.nn.functional import scaled_dot_product_attention

from services.engine.ops.triton import kernels
from services.engine.ops.triton.dispatch import (
    NUM_SEGMENTS,
    SPLIT_MAX_PROGRAMS,
    SPLIT_MIN_BLOCKS,
    KernelSpec,
    group_pad,
)

if TYPE_CHECKING:  # the backend's interface, in layers/: annotations only
    from services.engine.layers.attention import DecodeAttention
    from services.engine.layers.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class _FreshRow:
    """A prefill row with no cached prefix: its queries see only its own new tokens."""

    row: int  # its index in the step's row order
    token_start: int  # its first token in the step's flat order
    num_tokens: int


@dataclass(frozen=True)
class _StepLayout:
    query_start: torch.Tensor  # [num_rows + 1] int32: each row's first token in the step's flat order
    seq_lens: torch.Tensor  # [num_rows] int32: each row's context length, new tokens included
    num_decode: int
    split_decode: bool  # decode rows take split-KV + reduce; the paged kernel takes the prefill rows
    fresh_rows: tuple[_FreshRow, ...] = ()  # in row order; a captured decode step has none


class TritonAttention:
    name = "triton"
    graph_safe = True

    def __init__(self, spec: KernelSpec, num_heads: int, num_kv_heads: int, *, split: bool | None = None):
        """`split`: force split-KV decode on (True) or off (False); None decides per step."""
        self.spec = spec
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group_size = num_heads // num_kv_heads
        self.group_pad = group_pad(self.group_size)
        self.split = split
        self.block_size = spec.block_size
        self.upcast = kernels.INTERPRETED and spec.dtype == torch.bfloat16  # see kernels._dot

    def store(self, cache: torch.Tensor, meta: AttentionMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [num_tokens, kv_heads, head_dim] (last dim contiguous) into cache [slots, 2, kv_heads, hd]."""
        num_tokens = k.shape[0]
        if num_tokens == 0:
            return
        kernels.store_kv_kernel[(num_tokens, self.num_kv_heads)](
            k, v, cache, meta.slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cache.stride(0), cache.stride(1), cache.stride(2), HEAD_DIM=self.spec.head_dim,
        )  # fmt: skip

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        decode_attention: DecodeAttention | None = None,
        *,
        window: int | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads, head_dim] -> the same shape. k, v [num_tokens, kv_heads, head_dim] are
        already in the cache; only the fresh prompts' SDPA reads them. The paged kernel takes each run of
        rows between fresh prompts (row boundaries are host ints: no wait on the device)."""
        del decode_attention  # the C decode kernel is CPU-only
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        layout = self._layout(meta)
        scale = self.spec.head_dim**-0.5 if scale is None else scale
        qk_scale = scale * math.log2(math.e)
        win = window or 0
        row = token = 0  # the first row (and its first token) no launch has taken yet
        if layout.split_decode:
            self._split_decode(out, q, cache, meta, layout, qk_scale, win)
            row = token = layout.num_decode  # one token per decode row
        for fresh in layout.fresh_rows:
            if win and fresh.num_tokens > win:
                continue  # the window masks some of its keys and flash SDPA has no window: the kernel's mask
            num_tokens = fresh.token_start - token
            self._paged(out, q, cache, meta, layout, row, fresh.row - row, num_tokens, qk_scale, win)
            self._fresh(out, q, k, v, fresh, scale)
            row, token = fresh.row + 1, fresh.token_start + fresh.num_tokens
        num_rows = len(meta.decode_rows) + len(meta.prefill_rows)
        self._paged(out, q, cache, meta, layout, row, num_rows - row, meta.num_tokens - token, qk_scale, win)
        return out

    @staticmethod
    def _fresh(
        out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fresh: _FreshRow, scale: float
    ) -> None:
        """A prompt with no cached prefix: causal attention over its own new tokens, which SDPA (flash on a
        GPU) runs faster than the paged kernel's walk over the blocks they were just written to. Under
        Triton the cache holds the compute dtype (another engine.kv_cache_dtype is refused at load), so
        the new K/V are exactly what the kernel would read back."""
        tokens = slice(fresh.token_start, fresh.token_start + fresh.num_tokens)
        q_row, k_row, v_row = (t[tokens].transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, n, hd]
        attn = scaled_dot_product_attention(q_row, k_row, v_row, is_causal=True, scale=scale, enable_gqa=True)
        out[tokens] = attn[0].transpose(0, 1)  # [n, num_heads, head_dim]

    def _paged(
        self, out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
        layout: _StepLayout, first_row: int, num_rows: int, num_tokens: int, qk_scale: float, window: int,
    ) -> None:  # fmt: skip
        """Rows first_row..first_row + num_rows - 1, whose new tokens number num_tokens."""
        if num_rows == 0:
            return
        spec = self.spec
        block_q = spec.block_m // self.group_pad
        grid = (num_tokens // block_q + num_rows, self.num_kv_heads)  # tiles, an upper bound
        tables = meta.block_tables[first_row:]
        kernels.paged_attention_kernel[grid](
            out, q, cache, tables, layout.query_start[first_row:], layout.seq_lens[first_row:],
            qk_scale, window, num_rows, self.group_size, self.group_pad,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            cache.stride(0), cache.stride(1), cache.stride(2), tables.stride(0),
            HEAD_DIM=spec.head_dim, BLOCK_SIZE=spec.block_size, BLOCK_M=spec.block_m,
            PRECISION=spec.precision, UPCAST=self.upcast, num_warps=spec.num_warps,
            num_stages=spec.num_stages,
        )  # fmt: skip

    def _split_decode(
        self, out: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata,
        layout: _StepLayout, qk_scale: float, window: int,
    ) -> None:  # fmt: skip
        spec = self.spec
        rows = layout.num_decode
        parts = torch.empty(rows, self.num_heads, NUM_SEGMENTS, spec.head_dim, device=q.device)
        part_max = torch.empty(rows, self.num_heads, NUM_SEGMENTS, device=q.device)
        part_sum = torch.empty_like(part_max)
        kernels.split_decode_kernel[(rows, self.num_kv_heads, NUM_SEGMENTS)](
            parts, part_max, part_sum, q, cache, meta.block_tables, layout.query_start, layout.seq_lens,
            qk_scale, window, self.group_size,
            q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), cache.stride(2),
            meta.block_tables.stride(0),
            HEAD_DIM=spec.head_dim, BLOCK_SIZE=spec.block_size, BLOCK_M=max(spec.block_m, self.group_pad),
            PRECISION=spec.precision, UPCAST=self.upcast, NUM_SEGMENTS=NUM_SEGMENTS, num_warps=spec.num_warps,
            num_stages=spec.num_stages,
        )  # fmt: skip
        kernels.reduce_segments_kernel[(rows, self.num_heads)](
            out, parts, part_max, part_sum, layout.query_start, layout.seq_lens, out.stride(0), out.stride(1),
            HEAD_DIM=spec.head_dim, NUM_SEGMENTS=NUM_SEGMENTS,
        )  # fmt: skip

    def prepare_static(
        self, meta: AttentionMetadata, query_start: torch.Tensor, seq_lens: torch.Tensor
    ) -> None:
        """A captured decode step: the layout is these static buffers, and split-KV is decided by the
        row count alone (the context lengths change between replays)."""
        num = len(meta.decode_rows)
        split = self.split if self.split is not None else num * self.num_kv_heads <= SPLIT_MAX_PROGRAMS
        meta.backend_state[self] = _StepLayout(query_start, seq_lens, num, num > 0 and split)

    def _layout(self, meta: AttentionMetadata) -> _StepLayout:
        cached = meta.backend_state.get(self)
        if isinstance(cached, _StepLayout):
            return cached
        if meta.block_size != self.block_size:
            raise ValueError(f"KV blocks of {meta.block_size} tokens; these kernels take {self.block_size}")
        rows = (*meta.decode_rows, *meta.prefill_rows)
        starts = [0]
        for row in rows:
            starts.append(starts[-1] + row.num_new_tokens)
        num_decode = len(meta.decode_rows)
        fresh = tuple(
            _FreshRow(i, starts[i], row.num_new_tokens)
            for i, row in enumerate(rows[num_decode:], num_decode)
            if row.start_position == 0 and row.num_new_tokens > 0
        )
        layout = _StepLayout(
            _int32(starts, meta.device), _int32([r.context_len for r in rows], meta.device), num_decode,
            num_decode > 0 and self._splits(meta), fresh,
        )  # fmt: skip
        meta.backend_state[self] = layout
        return layout

    def _splits(self, meta: AttentionMetadata) -> bool:
        if self.split is not None:
            return self.split
        longest = max(r.context_len for r in meta.decode_rows)
        few = len(meta.decode_rows) * self.num_kv_heads <= SPLIT_MAX_PROGRAMS
        return few and longest >= SPLIT_MIN_BLOCKS * self.spec.block_size


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.int32)
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)
