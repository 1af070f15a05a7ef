"""The fast batched sampler agrees with the slow per-row reference on mixed batches."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch

from services.common.sampling import SamplingParams
from services.engine.layers.sampler import SamplingBatch, SamplingRow, compute_probs, sample
from services.engine.ops.reference import reference_sample_probs, reference_sample_token

VOCAB_SIZE = 64

TEMPERATURES = (0.0, 0.5, 1.0, 1.7)
TOP_KS = (0, 1, 5, 40, 100)
TOP_PS = (1.0, 0.9, 0.5, 1e-3)
MIN_PS = (0.0, 0.05, 0.3)
REPETITION_PENALTIES = (1.0, 1.3, 0.8)
FREQUENCY_PRESENCE = ((0.0, 0.0), (0.5, -0.3), (-1.0, 1.5))
GRID = list(itertools.product(TEMPERATURES, TOP_KS, TOP_PS, MIN_PS, REPETITION_PENALTIES, FREQUENCY_PRESENCE))


def _random_rows(rng: random.Random, num_rows: int) -> list[SamplingRow]:
    rows = []
    for temperature, top_k, top_p, min_p, repetition, (frequency, presence) in rng.sample(GRID, num_rows):
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition,
            frequency_penalty=frequency,
            presence_penalty=presence,
        )
        prompt = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 30))]
        output = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(0, 20))]
        banned = rng.sample(range(VOCAB_SIZE), rng.choice((0, 0, 1, 3)))
        rows.append(SamplingRow(params, prompt, output, banned))
    return rows


@pytest.mark.parametrize("batch_seed", range(6))
def test_fast_probs_match_reference_on_mixed_batches(batch_seed: int) -> None:
    rng = random.Random(batch_seed)
    rows = _random_rows(rng, num_rows=48)
    generator = torch.Generator().manual_seed(batch_seed)
    logits = torch.randn(len(rows), VOCAB_SIZE, generator=generator) * 2.0  # [num_rows, vocab_size]
    fast = compute_probs(logits, SamplingBatch.build(rows, VOCAB_SIZE))  # [num_rows, vocab_size]
    for i, row in enumerate(rows):
        expected = reference_sample_probs(
            logits[i], row.params, row.prompt_token_ids, row.output_token_ids, row.banned_token_ids
        )  # [vocab_size]
        torch.testing.assert_close(fast[i], expected, atol=1e-6, rtol=0.0, msg=f"row {i}: {row.params}")


def test_fast_probs_match_reference_for_a_single_filter_kind() -> None:
    logits = torch.randn(4, VOCAB_SIZE, generator=torch.Generator().manual_seed(9))  # [4, vocab_size]
    params = [
        SamplingParams(top_k=7),
        SamplingParams(top_p=0.7),
        SamplingParams(min_p=0.1),
        SamplingParams(repetition_penalty=1.2),
    ]
    for i, row_params in enumerate(params):
        row = SamplingRow(row_params, [1, 2], [2, 3])
        fast = compute_probs(logits[i : i + 1], SamplingBatch.build([row], VOCAB_SIZE))[0]  # [vocab_size]
        expected = reference_sample_probs(logits[i], row_params, [1, 2], [2, 3])  # [vocab_size]
        torch.testing.assert_close(fast, expected, atol=1e-6, rtol=0.0)


def test_top_p_agrees_with_reference_whether_the_cut_is_among_the_candidates_or_not() -> None:
    vocab_size = 1000  # more than the 256 top_p candidates
    generator = torch.Generator().manual_seed(10)
    scales = torch.tensor([0.1, 6.0, 0.1, 6.0, 1.0, 0.1])  # [6]: flat rows need the full sort
    logits = torch.randn(6, vocab_size, generator=generator) * scales.unsqueeze(1)  # [6, vocab_size]
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=1.0, min_p=0.5),
        SamplingParams(top_p=0.5, top_k=300),
        SamplingParams(top_p=0.95, temperature=0.7),
        SamplingParams(top_p=0.2, top_k=100),
    ]
    rows = [SamplingRow(row_params, [0], []) for row_params in params]
    fast = compute_probs(logits, SamplingBatch.build(rows, vocab_size))  # [6, vocab_size]
    for i, row in enumerate(rows):
        expected = reference_sample_probs(logits[i], row.params, [0], [])  # [vocab_size]
        torch.testing.assert_close(fast[i], expected, atol=1e-6, rtol=0.0)
    assert int((fast[0] > 0).sum()) > 256 and int((fast[1] > 0).sum()) < 256


@pytest.mark.parametrize("batch_seed", range(6))
def test_seeded_and_greedy_tokens_equal_the_reference_token_on_mixed_batches(batch_seed: int) -> None:
    rng = random.Random(100 + batch_seed)
    rows = [
        replace(row, params=replace(row.params, seed=rng.choice((0, 2**63 - 1, rng.getrandbits(63)))))
        for row in _random_rows(rng, num_rows=48)
    ]
    generator = torch.Generator().manual_seed(batch_seed)
    logits = torch.randn(len(rows), VOCAB_SIZE, generator=generator) * 2.0  # [num_rows, vocab_size]
    fast = sample(logits, SamplingBatch.build(rows, VOCAB_SIZE), generator).token_ids
    expected = [
        reference_sample_token(
            logits[i], row.params, row.prompt_token_ids, row.output_token_ids, row.banned_token_ids
        )
        for i, row in enumerate(rows)
    ]
    assert fast == expected


def test_reference_token_refuses_an_unseeded_sampled_row() -> None:
    with pytest.raises(ValueError, match="unseeded"):
        reference_sample_token(torch.zeros(VOCAB_SIZE), SamplingParams(), [1], [])
