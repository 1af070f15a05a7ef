"""Triton kernels over the paged KV cache: the KV store, one paged attention kernel, split-KV decode.

The cache of one layer is `[num_slots, 2, num_kv_heads, head_dim]` (attention.py): slot
`block_id * BLOCK_SIZE + offset` holds one token's K (index 0) and V (index 1), so one block of one KV
head is BLOCK_SIZE rows of HEAD_DIM contiguous elements. Every kernel takes strides, not shapes.

A step's query tokens are flat, row after row; `query_start[r]..query_start[r + 1]` are row r's, and
`seq_lens[r]` is its context length once they are written (its new tokens are the last positions).

- `store_kv_kernel`: one program per (token, KV head) writes K and V through the slot mapping; a slot
  below 0 (padding) is skipped.
- `paged_attention_kernel`: one program per (query tile, KV head). A tile is BLOCK_M query rows: up to
  BLOCK_M // group_pad tokens of one row, each with the group_pad query heads that share this KV head
  (GQA packing, so each K/V block is read once for all of them). It walks the row's blocks in order with
  an online softmax, so one kernel serves decode rows, prefill chunks over a cached prefix and mixed
  batches alike. Tiles are found from the program id by a binary search over `query_start`.
- `split_decode_kernel` + `reduce_segments_kernel`: for decode rows (one query token each) with few rows
  and long contexts, each row's blocks are cut into NUM_SEGMENTS segments attended by separate programs;
  the reduce merges their partial softmax sums.

Causal masking is by position: a query at position p sees keys 0..p; with `window > 0` only keys
> p - window (transformers' sliding-window mask). Blocks wholly below a tile's window are not visited,
so a freed block id there is never read. Scores are kept in log2 units (`qk_scale` = scale * log2 e).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# True when these kernels were defined under TRITON_INTERPRET=1: they then run on CPU tensors only. Triton's
# own library functions (tl.max, tl.sum, ...) are interpreted only if the variable was set before triton
# was first imported (torch imports it), and the kernels' helpers need them to be.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
LIBRARY_INTERPRETED = type(tl.max).__name__ == "InterpretedFunction"


@triton.jit
def store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ckv, stride_ch,
    HEAD_DIM: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        d = tl.arange(0, HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + head * stride_kh + d)
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + d)
        dst = cache_ptr + slot * stride_cs + head * stride_ch + d
        tl.store(dst, k.to(cache_ptr.dtype.element_ty))
        tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty))


@triton.jit
def _find_row(query_start_ptr, tile, num_rows, block_q):
    """The last row whose first tile is at or before `tile`; row r's tiles start at
    (query_start[r] - query_start[0]) // block_q + r, so a row of q_len tokens owns cdiv(q_len, block_q)
    of them (at least one: an empty row's tile exits at once)."""
    first = tl.load(query_start_ptr)
    lo = 0
    hi = num_rows
    while lo < hi:
        mid = (lo + hi) // 2
        start = (tl.load(query_start_ptr + mid) - first) // block_q + mid
        if start <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b accumulated in fp32; UPCAST multiplies in fp32 (Triton 3.7.1's interpreter multiplies bf16
    operands as their raw uint16 bits, so interpreted bf16 kernels set it; compiled ones never do)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend_blocks(
    q, q_pos, row_ok, seq_len, window, qk_scale, cache_ptr, table_ptr, kv_head, block_lo, block_hi,
    stride_cs, stride_ckv, stride_ch,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    """Online softmax of q [BLOCK_M, HEAD_DIM] over blocks block_lo..block_hi-1 of one row: the unscaled
    accumulator [BLOCK_M, HEAD_DIM], the running max and the running sum [BLOCK_M] (log2 units)."""
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, BLOCK_SIZE)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for blk in range(block_lo, block_hi):
        block_id = tl.load(table_ptr + blk).to(tl.int64)
        key_pos = blk * BLOCK_SIZE + j  # [BLOCK_SIZE]
        in_ctx = key_pos < seq_len
        rows = cache_ptr + (block_id * BLOCK_SIZE + j)[:, None] * stride_cs + kv_head * stride_ch
        k = tl.load(rows + d[None, :], mask=in_ctx[:, None], other=0.0)  # [BLOCK_SIZE, HEAD_DIM]
        v = tl.load(rows + stride_ckv + d[None, :], mask=in_ctx[:, None], other=0.0)
        s = _dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # [BLOCK_M, BLOCK_SIZE]
        allowed = (key_pos[None, :] <= q_pos[:, None]) & row_ok[:, None]
        allowed = allowed & ((window <= 0) | (key_pos[None, :] > q_pos[:, None] - window))
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_SIZE]
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _first_block(first_pos, window, BLOCK_SIZE: tl.constexpr):
    """The first block a query at `first_pos` or later can see: 0 without a window."""
    lo = 0
    if window > 0:
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_SIZE
    return lo


# Arguments that change from step to step are not specialised on (Triton would compile a variant the first
# time a value is 1 or a multiple of 16, or a pointer loses 16-byte alignment: a stall in the middle of
# serving); what aot.py compiles is exactly these generic variants. `stride_bt` is the block table's width,
# the step's most blocks in one row: 1, 3, 16 and 17 would otherwise be three variants.
_STEP_ARGS = ["num_rows", "window", "stride_bt"]
_STEP_POINTERS = ["tables_ptr", "query_start_ptr", "seq_lens_ptr"]


@triton.jit(do_not_specialize=_STEP_ARGS, do_not_specialize_on_alignment=_STEP_POINTERS)
def paged_attention_kernel(
    out_ptr, q_ptr, cache_ptr, tables_ptr, query_start_ptr, seq_lens_ptr,
    qk_scale, window, num_rows, group_size, group_pad,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cs, stride_ckv, stride_ch, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    block_q = BLOCK_M // group_pad
    row = _find_row(query_start_ptr, tile, num_rows, block_q)
    q_start = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_start
    local = tile - ((q_start - tl.load(query_start_ptr)) // block_q + row)
    if local * block_q < q_len:
        seq_len = tl.load(seq_lens_ptr + row)
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        q_tok = local * block_q + m // group_pad  # [BLOCK_M] index within the row
        in_group = m % group_pad
        row_ok = (q_tok < q_len) & (in_group < group_size)
        head = (kv_head * group_size + in_group).to(tl.int64)
        token = (q_start + q_tok).to(tl.int64)
        q_pos = seq_len - q_len + q_tok
        q = tl.load(
            q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
            mask=row_ok[:, None], other=0.0,
        )  # fmt: skip
        first_pos = seq_len - q_len + local * block_q
        last_pos = seq_len - q_len + tl.minimum((local + 1) * block_q, q_len) - 1
        table = tables_ptr + row.to(tl.int64) * stride_bt
        acc, _, l_i = _attend_blocks(
            q, q_pos, row_ok, seq_len, window, qk_scale, cache_ptr, table, kv_head,
            _first_block(first_pos, window, BLOCK_SIZE), last_pos // BLOCK_SIZE + 1,
            stride_cs, stride_ckv, stride_ch, HEAD_DIM, BLOCK_SIZE, BLOCK_M, PRECISION, UPCAST,
        )  # fmt: skip
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None],
        )  # fmt: skip


@triton.jit(do_not_specialize=["window", "stride_bt"])
def split_decode_kernel(
    part_acc_ptr, part_max_ptr, part_sum_ptr, q_ptr, cache_ptr, tables_ptr, query_start_ptr, seq_lens_ptr,
    qk_scale, window, group_size,
    stride_qt, stride_qh, stride_cs, stride_ckv, stride_ch, stride_bt,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):  # fmt: skip
    """Rows of one query token each. Partials: acc [rows, heads, NUM_SEGMENTS, HEAD_DIM] and max, sum
    [rows, heads, NUM_SEGMENTS], all float32 and contiguous."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    num_heads = tl.num_programs(1) * group_size
    seq_len = tl.load(seq_lens_ptr + row)
    m = tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    row_ok = (m < group_size) & (seq_len > 0)
    head = (kv_head * group_size + m).to(tl.int64)
    token = tl.load(query_start_ptr + row).to(tl.int64)
    q = tl.load(
        q_ptr + token * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None], other=0.0
    )
    q_pos = tl.zeros([BLOCK_M], tl.int32) + seq_len - 1
    block_lo = _first_block(seq_len - 1, window, BLOCK_SIZE)
    block_hi = tl.cdiv(seq_len, BLOCK_SIZE)
    per_segment = tl.cdiv(block_hi - block_lo, NUM_SEGMENTS)
    seg_lo = block_lo + segment * per_segment
    seg_hi = tl.minimum(seg_lo + per_segment, block_hi)
    acc, m_i, l_i = _attend_blocks(
        q, q_pos, row_ok, seq_len, window, qk_scale, cache_ptr, tables_ptr + row.to(tl.int64) * stride_bt,
        kv_head, seg_lo, seg_hi, stride_cs, stride_ckv, stride_ch, HEAD_DIM, BLOCK_SIZE, BLOCK_M, PRECISION,
        UPCAST,
    )  # fmt: skip
    part = (row.to(tl.int64) * num_heads + head) * NUM_SEGMENTS + segment  # [BLOCK_M]
    tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
    tl.store(part_max_ptr + part, m_i, mask=row_ok)
    tl.store(part_sum_ptr + part, l_i, mask=row_ok)


@triton.jit
def reduce_segments_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_ptr, seq_lens_ptr,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):  # fmt: skip
    """Merges one (row, head)'s segment partials into its output; a padded row (no context) gets 0."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_heads = tl.num_programs(1)
    seg = tl.arange(0, NUM_SEGMENTS)
    d = tl.arange(0, HEAD_DIM)
    part = (row * num_heads + head) * NUM_SEGMENTS + seg  # [NUM_SEGMENTS]
    has_ctx = tl.load(seq_lens_ptr + row) > 0
    seg_max = tl.load(part_max_ptr + part, mask=has_ctx, other=float("-inf"))
    seg_sum = tl.load(part_sum_ptr + part, mask=has_ctx, other=0.0)
    top = tl.max(seg_max, 0)
    weight = tl.exp2(seg_max - tl.where(top == float("-inf"), 0.0, top))  # [NUM_SEGMENTS]
    weight = tl.where(seg_max == float("-inf"), 0.0, weight)
    total = tl.sum(seg_sum * weight, 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], mask=has_ctx, other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)  # [HEAD_DIM]
    token = tl.load(query_start_ptr + row).to(tl.int64)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))
