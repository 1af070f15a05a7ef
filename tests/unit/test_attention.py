"""Both fast attention paths (torch SDPA and the C kernel) against `reference_attention`, on random caches
with shuffled block tables, mixed decode and prefill rows, prefix rows and GQA."""

from __future__ import annotations

import pytest
import torch

from services.engine.layers.attention import paged_attention, write_kv
from services.engine.layers.attention_metadata import RowSpec, build_metadata
from services.engine.ops.build import load_cpu_kernels
from services.engine.ops.cpu import CpuKernels
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags
from services.engine.ops.reference import reference_attention
from services.engine.scheduling.block_pool import NO_BLOCK

BLOCK_SIZE = 4
TOL = 1e-5


def make_rows(
    specs: list[tuple[int, int]], num_blocks: int, generator: torch.Generator, block_size: int = BLOCK_SIZE
) -> tuple[list[RowSpec], list[RowSpec]]:
    """(start_position, num_new_tokens) per row -> decode rows, prefill rows over shuffled block ids."""
    free = torch.randperm(num_blocks, generator=generator).tolist()
    decode, prefill = [], []
    for start, num_new in specs:
        num_row_blocks = -(-(start + num_new) // block_size) + 1  # one spare block, as a running row has
        block_ids = [free.pop() for _ in range(num_row_blocks)]
        (decode if num_new == 1 else prefill).append(RowSpec(block_ids, start, num_new))
    return decode, prefill


def setup_step(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int = 16,
    seed: int = 0,
    block_size: int = BLOCK_SIZE,
    kv_dtype: torch.dtype = torch.float32,
) -> tuple[list[RowSpec], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows in flat order, q [tokens, heads, hd], new k/v [tokens, kv_heads, hd], and a cache (of
    `kv_dtype`) holding random old context plus the new k/v already written."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = max(64, sum(-(-(start + num_new) // block_size) + 1 for start, num_new in specs))
    decode, prefill = make_rows(specs, num_blocks, g, block_size)
    rows = decode + prefill
    num_tokens = sum(r.num_new_tokens for r in rows)
    shape = (num_blocks * block_size, 2, num_kv_heads, head_dim)
    cache = torch.randn(*shape, generator=g).to(kv_dtype)  # [slots, 2, kv_heads, head_dim]
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g)  # [tokens, heads, hd]
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)  # [tokens, kvh, hd]
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g)  # [tokens, kvh, hd]
    meta = build_metadata(decode, prefill, block_size)
    write_kv(cache, meta.slot_mapping, k, v)
    return rows, q, k, v, cache


CASES = {
    "decode-only": [(5, 1), (17, 1), (1, 1), (9, 1)],
    "fresh-prefills": [(0, 7), (0, 3), (0, 12)],
    "mixed-decode-prefill-prefix": [(11, 1), (3, 1), (0, 9), (8, 6), (13, 1), (4, 2)],
    "lone-fresh-prompt": [(0, 19)],
    "lone-prefix-chunk": [(12, 9)],
    # Contexts over the C kernel's 64-key chunks: one chunk exactly, chunk edges, a prefill across chunks.
    "long-contexts": [(150, 1), (63, 1), (64, 1), (200, 1), (120, 20)],
}


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    if not can_run_cpu_kernels(cpu_flags()):
        pytest.skip("the CPU lacks AVX2/FMA, which the C kernels need")
    loaded = load_cpu_kernels()  # a build error raises KernelBuildError here and fails every test
    assert loaded is not None
    return loaded


KV_DTYPES = {"kv-fp32": torch.float32, "kv-fp16": torch.float16}  # engine.kv_cache_dtype on the CPU


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
def test_torch_path_matches_reference(case: str, num_heads: int, num_kv_heads: int, kv: str) -> None:
    """fp32 queries over an fp32 or fp16 cache: the reference reads the cache's values exactly, so the
    fp16 cache is held to the same tolerance (a fresh prompt must attend its k, v as stored)."""
    rows, q, k, v, cache = setup_step(CASES[case], num_heads, num_kv_heads, kv_dtype=KV_DTYPES[kv])
    decode = [r for r in rows if r.num_new_tokens == 1]
    meta = build_metadata(decode, rows[len(decode) :], BLOCK_SIZE)
    got = paged_attention(q, k, v, cache, meta)
    want = reference_attention(q, cache, rows, BLOCK_SIZE)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4), (9, 3)])
def test_kernel_matches_reference(
    kernels: CpuKernels, case: str, num_heads: int, num_kv_heads: int, kv: str
) -> None:
    head_dim = 64 if num_heads == 9 else 16
    rows, q, _, _, cache = setup_step(CASES[case], num_heads, num_kv_heads, head_dim, kv_dtype=KV_DTYPES[kv])
    decode = [r for r in rows if r.num_new_tokens == 1]
    meta = build_metadata(decode, rows[len(decode) :], BLOCK_SIZE)
    flat_q = q.reshape(q.shape[0], -1)  # [tokens, heads * hd]
    out = torch.empty_like(flat_q)  # [tokens, heads * hd]
    kernels.paged_attention(
        flat_q, out, cache, meta.block_tables, meta.token_rows, meta.positions, BLOCK_SIZE,
    )  # fmt: skip
    want = reference_attention(q, cache, rows, BLOCK_SIZE)
    torch.testing.assert_close(out.view_as(q), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("case", ["mixed-decode-prefill-prefix", "long-contexts"])
def test_kernel_gives_a_token_the_same_bits_alone_and_in_a_batch(kernels: CpuKernels, case: str) -> None:
    rows, q, _, _, cache = setup_step(CASES[case], 6, 2)
    decode = [r for r in rows if r.num_new_tokens == 1]
    flat_q = q.reshape(q.shape[0], -1)  # [tokens, heads * hd]

    def run(step_decode: list[RowSpec], step_prefill: list[RowSpec], step_q: torch.Tensor) -> torch.Tensor:
        meta = build_metadata(step_decode, step_prefill, BLOCK_SIZE)
        out = torch.empty_like(step_q)  # [tokens, heads * hd]
        kernels.paged_attention(
            step_q, out, cache, meta.block_tables, meta.token_rows, meta.positions, BLOCK_SIZE,
        )  # fmt: skip
        return out

    batched = run(decode, rows[len(decode) :], flat_q)
    for i, row in enumerate(decode):  # "long-contexts": one to four chunks of keys
        assert torch.equal(batched[i : i + 1], run([row], [], flat_q[i : i + 1]))


@pytest.mark.parametrize(
    ("block_size", "head_dim", "window"), [(128, 96, None), (128, 96, 100), (16, 128, 70)]
)
def test_kernel_over_wide_blocks_and_heads_matches_reference_with_any_thread_count(
    kernels: CpuKernels, block_size: int, head_dim: int, window: int | None
) -> None:
    """Blocks wider than the kernel's 64-key chunks (chunk edges mid-block), head_dim past one 64-wide pass
    over the values, GQA 8/2; the bits do not depend on the number of threads."""
    rows, q, _, _, cache = setup_step(CASES["long-contexts"], 8, 2, head_dim, block_size=block_size)
    decode = [r for r in rows if r.num_new_tokens == 1]
    meta = build_metadata(decode, rows[len(decode) :], block_size)
    flat_q = q.reshape(q.shape[0], -1)  # [tokens, heads * hd]
    outs = []
    threads = torch.get_num_threads()
    for num_threads in (1, 3):
        torch.set_num_threads(num_threads)
        try:
            out = torch.empty_like(flat_q)  # [tokens, heads * hd]
            kernels.paged_attention(
                flat_q, out, cache, meta.block_tables, meta.token_rows, meta.positions, block_size,
                window=window,
            )  # fmt: skip
        finally:
            torch.set_num_threads(threads)
        outs.append(out)
    want = reference_attention(q, cache, rows, block_size, window=window)
    torch.testing.assert_close(outs[0].view_as(q), want, atol=TOL, rtol=TOL)
    assert torch.equal(outs[0], outs[1])


def test_metadata_maps_each_token_to_its_block_slot() -> None:
    rows = [RowSpec([7, 2], 5, 1), RowSpec([3, 9, 4], 2, 7)]
    meta = build_metadata(rows[:1], rows[1:], BLOCK_SIZE)
    assert meta.positions.tolist() == [5, 2, 3, 4, 5, 6, 7, 8]
    # block_id * 4 + offset: row 0 at position 5 -> block 2; row 1 at 2..8 -> blocks 3, 9, 4
    assert meta.slot_mapping.tolist() == [9, 14, 15, 36, 37, 38, 39, 16]
    assert meta.token_rows.tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    assert meta.block_tables.tolist() == [[7, 2, 0], [3, 9, 4]]
    assert meta.max_context_len == 9
    assert not meta.is_fresh_prompt
    assert build_metadata([], [RowSpec([1], 0, 3)], BLOCK_SIZE).is_fresh_prompt


def test_write_kv_stores_k_and_v_at_their_slots() -> None:
    cache = torch.zeros(8, 2, 2, 4)  # [slots, 2, kvh, hd]
    k = torch.randn(3, 2, 4)  # [tokens, kvh, hd]
    v = torch.randn(3, 2, 4)  # [tokens, kvh, hd]
    write_kv(cache, torch.tensor([6, 0, 3]), k, v)
    for i, slot in enumerate([6, 0, 3]):
        assert torch.equal(cache[slot, 0], k[i]) and torch.equal(cache[slot, 1], v[i])
    assert cache[[1, 2, 4, 5, 7]].abs().sum() == 0


# -- sliding windows ---------------------------------------------------------------------------------

WINDOW_CASES = {
    "decode-only": CASES["decode-only"],
    "mixed-decode-prefill-prefix": CASES["mixed-decode-prefill-prefix"],
    "lone-fresh-prompt": CASES["lone-fresh-prompt"],
    "lone-prefix-chunk": CASES["lone-prefix-chunk"],
    "long-contexts": CASES["long-contexts"],
}


@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
@pytest.mark.parametrize("window", [1, 3, 6, 64])
def test_torch_path_with_window_and_scale_matches_reference(case: str, window: int) -> None:
    rows, q, k, v, cache = setup_step(WINDOW_CASES[case], 6, 2)
    decode = [r for r in rows if r.num_new_tokens == 1]
    meta = build_metadata(decode, rows[len(decode) :], BLOCK_SIZE)
    got = paged_attention(q, k, v, cache, meta, window=window, scale=0.3)
    want = reference_attention(q, cache, rows, BLOCK_SIZE, window=window, scale=0.3)
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("case", sorted(WINDOW_CASES))
@pytest.mark.parametrize("window", [1, 3, 6, 9, 64, 100])
def test_kernel_with_window_and_scale_matches_reference(kernels: CpuKernels, case: str, window: int) -> None:
    rows, q, _, _, cache = setup_step(WINDOW_CASES[case], 6, 2)
    decode = [r for r in rows if r.num_new_tokens == 1]
    meta = build_metadata(decode, rows[len(decode) :], BLOCK_SIZE)
    flat_q = q.reshape(q.shape[0], -1)  # [tokens, heads * hd]
    out = torch.empty_like(flat_q)  # [tokens, heads * hd]
    kernels.paged_attention(
        flat_q, out, cache, meta.block_tables, meta.token_rows, meta.positions, BLOCK_SIZE,
        window=window, scale=0.3,
    )  # fmt: skip
    want = reference_attention(q, cache, rows, BLOCK_SIZE, window=window, scale=0.3)
    torch.testing.assert_close(out.view_as(q), want, atol=TOL, rtol=TOL)


def test_a_window_wider_than_the_context_changes_no_bit(kernels: CpuKernels) -> None:
    rows, q, k, v, cache = setup_step(CASES["mixed-decode-prefill-prefix"], 6, 2)
    decode = [r for r in rows if r.num_new_tokens == 1]
    meta = build_metadata(decode, rows[len(decode) :], BLOCK_SIZE)
    assert torch.equal(
        paged_attention(q, k, v, cache, meta, window=1000), paged_attention(q, k, v, cache, meta)
    )
    flat_q = q.reshape(q.shape[0], -1)  # [tokens, heads * hd]
    outs = []
    for window in (None, 1000):
        out = torch.empty_like(flat_q)  # [tokens, heads * hd]
        kernels.paged_attention(
            flat_q, out, cache, meta.block_tables, meta.token_rows, meta.positions, BLOCK_SIZE,
            window=window,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


def test_freed_blocks_before_the_window_are_never_read(kernels: CpuKernels) -> None:
    """Rows whose leading blocks were freed (NO_BLOCK) attend exactly as with their blocks in place."""
    window = 5
    rows, q, k, v, cache = setup_step([(17, 1), (13, 1), (12, 6)], 6, 2)
    decode = [r for r in rows if r.num_new_tokens == 1]
    # Blocks wholly before every query's window: (start - window + 1) // BLOCK_SIZE of them.
    freed = [
        RowSpec([NO_BLOCK] * ((r.start_position - window + 1) // BLOCK_SIZE)
                + list(r.block_ids[(r.start_position - window + 1) // BLOCK_SIZE :]),
                r.start_position, r.num_new_tokens)
        for r in rows
    ]  # fmt: skip
    assert all(NO_BLOCK in r.block_ids for r in freed)
    want = reference_attention(q, cache, rows, BLOCK_SIZE, window=window)
    meta = build_metadata(freed[: len(decode)], freed[len(decode) :], BLOCK_SIZE)
    torch.testing.assert_close(paged_attention(q, k, v, cache, meta, window=window), want, atol=TOL, rtol=TOL)
    flat_q = q.reshape(q.shape[0], -1)  # [tokens, heads * hd]
    out = torch.empty_like(flat_q)  # [tokens, heads * hd]
    kernels.paged_attention(
        flat_q, out, cache, meta.block_tables, meta.token_rows, meta.positions, BLOCK_SIZE,
        window=window,
    )  # fmt: skip
    torch.testing.assert_close(out.view_as(q), want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize("kv", sorted(KV_DTYPES))
@pytest.mark.parametrize("position", [2, 9, 70])  # in a chunk's first 8 keys, past them, a later chunk
def test_kernel_skips_a_key_whose_score_is_nan(kernels: CpuKernels, kv: str, position: int) -> None:
    """A key whose score is NaN (garbage, or an overflowed fp16 cache: inf - inf) gets no weight, as if
    scored -inf, and hides no other key from the chunk's maximum: a loud key 8 further on (the same
    vector lane) still takes all the weight, where a maximum that lost it would overflow exp."""
    rows, q, _, _, cache = setup_step([(99, 1)], 4, 4, kv_dtype=KV_DTYPES[kv])
    (row,) = rows

    def slot(pos: int) -> int:
        return row.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE

    for h in range(4):  # scores of 150 after the 1/4 scale: every other key's weight is below e^-140
        cache[slot(position + 8), 0, h] = (600 * q[0, h] / q[0, h].norm() ** 2).to(cache.dtype)
    scored_out = cache.clone()
    for h in range(4):  # the reference's stand-in: a key pointing away from each head's query
        scored_out[slot(position), 0, h] = (-1e3 * q[0, h] / q[0, h].norm()).to(cache.dtype)
    want = reference_attention(q, scored_out, rows, BLOCK_SIZE)
    cache[slot(position), 0, :, 0] = float("nan")
    meta = build_metadata(rows, [], BLOCK_SIZE)
    flat_q = q.reshape(1, -1)  # [1, heads * hd]
    out = torch.empty_like(flat_q)  # [1, heads * hd]
    kernels.paged_attention(
        flat_q, out, cache, meta.block_tables, meta.token_rows, meta.positions, BLOCK_SIZE
    )  # fmt: skip
    torch.testing.assert_close(out.view_as(q), want, atol=TOL, rtol=TOL)
