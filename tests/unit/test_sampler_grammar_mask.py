"""The sampler's grammar mask (`SamplingBatch.allowed`) agrees with the per-row reference: rows with a
bitmask sample only allowed tokens, after the bans and before the filters; other rows are untouched."""

from __future__ import annotations

import random

import pytest
import torch

from services.common.sampling import SamplingParams
from services.engine.layers.sampler import AllowedTokens, SamplingBatch, SamplingRow, compute_probs, sample
from services.engine.ops.reference import reference_sample_probs, reference_sample_token

VOCAB_SIZE = 200  # not a multiple of 32: the last word's high bits lie past the vocabulary
NUM_WORDS = 7
PARAMS = (
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.7, top_k=5, seed=12),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, seed=13),
    SamplingParams(temperature=1.0, repetition_penalty=1.3, seed=14),
)


def bitmask_of(allowed: set[int]) -> list[int]:
    """int32 words, bit v % 32 of word v // 32 set for each allowed token; stray bits past the vocab."""
    words = [0] * NUM_WORDS
    for token_id in [*allowed, VOCAB_SIZE + 3]:
        words[token_id // 32] |= 1 << (token_id % 32)
    return [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # as signed int32


def mixed_batch(seed: int) -> tuple[list[SamplingRow], dict[int, set[int]], AllowedTokens]:
    rng = random.Random(seed)
    rows, allowed_sets = [], {}
    for i in range(10):
        banned = rng.sample(range(VOCAB_SIZE - 1), rng.choice((0, 2)))  # the last token: never banned
        rows.append(SamplingRow(PARAMS[i % len(PARAMS)], [1, 2, 3], [4, 5][: i % 3], banned))
        if rng.random() < 0.6:  # a row with a grammar: a few tokens, the high ones among them sometimes
            allowed_sets[i] = set(rng.sample(range(VOCAB_SIZE), rng.choice((1, 3, 40)))) | {VOCAB_SIZE - 1}
    row_ids = sorted(allowed_sets)
    bitmask = torch.tensor([bitmask_of(allowed_sets[i]) for i in row_ids], dtype=torch.int32)
    allowed = AllowedTokens(torch.tensor(row_ids, dtype=torch.int64), bitmask)  # [num_masked, NUM_WORDS]
    return rows, allowed_sets, allowed


@pytest.mark.parametrize("seed", range(4))
def test_masked_probs_match_the_reference(seed: int) -> None:
    rows, allowed_sets, allowed = mixed_batch(seed)
    logits = torch.randn(len(rows), VOCAB_SIZE, generator=torch.Generator().manual_seed(seed))
    fast = compute_probs(logits, SamplingBatch.build(rows, VOCAB_SIZE, allowed=allowed))
    for i, row in enumerate(rows):
        expected = reference_sample_probs(
            logits[i], row.params, row.prompt_token_ids, row.output_token_ids, row.banned_token_ids,
            allowed_sets.get(i),
        )  # fmt: skip
        torch.testing.assert_close(fast[i], expected, atol=1e-6, rtol=0.0, msg=f"row {i}")


@pytest.mark.parametrize("seed", range(4))
def test_masked_rows_pick_the_reference_token_and_only_allowed_ones(seed: int) -> None:
    rows, allowed_sets, allowed = mixed_batch(seed)
    logits = torch.randn(len(rows), VOCAB_SIZE, generator=torch.Generator().manual_seed(100 + seed))
    logits[:, VOCAB_SIZE - 8 :] += 50.0  # noise would take these; only a grammar that allows them may
    picked = sample(logits, SamplingBatch.build(rows, VOCAB_SIZE, allowed=allowed), torch.Generator())
    for i, row in enumerate(rows):
        want = reference_sample_token(
            logits[i], row.params, row.prompt_token_ids, row.output_token_ids, row.banned_token_ids,
            allowed_sets.get(i),
        )  # fmt: skip
        assert picked.token_ids[i] == want, f"row {i}"
        if i in allowed_sets:
            assert want in allowed_sets[i]


def test_every_row_masked_is_the_same_as_masking_them_one_by_one() -> None:
    """Masking every row of a batch at once gives each row what masking it alone gives."""
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], []) for _ in range(3)]
    allowed_sets = [{5, 9}, {150}, {0, 199}]
    bitmask = torch.tensor([bitmask_of(s) for s in allowed_sets], dtype=torch.int32)
    logits = torch.randn(3, VOCAB_SIZE, generator=torch.Generator().manual_seed(3))
    everything = AllowedTokens(torch.arange(3), bitmask)
    together = compute_probs(logits, SamplingBatch.build(rows, VOCAB_SIZE, allowed=everything))
    for i in range(3):
        alone = AllowedTokens(torch.tensor([i]), bitmask[i : i + 1])
        one = compute_probs(logits, SamplingBatch.build(rows, VOCAB_SIZE, allowed=alone))
        assert torch.equal(together[i], one[i])
        assert int(together[i].argmax()) in allowed_sets[i]


def test_a_bitmask_narrower_than_the_logits_is_refused() -> None:
    rows = [SamplingRow(SamplingParams(temperature=0.0), [1], [])]
    narrow = AllowedTokens(torch.tensor([0]), torch.zeros((1, NUM_WORDS - 1), dtype=torch.int32))
    with pytest.raises(ValueError, match="does not cover"):
        SamplingBatch.build(rows, VOCAB_SIZE, allowed=narrow)
