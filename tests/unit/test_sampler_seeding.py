"""Seeded sampling: a token is a function of (logits, params, seed, output position) only."""

from __future__ import annotations

import torch

from services.common.sampling import SamplingParams
from services.engine.sampler import SamplingBatch, SamplingRow, derive_seed, sample

VOCAB_SIZE = 1000


def _row(params: SamplingParams, num_outputs: int) -> SamplingRow:
    return SamplingRow(params=params, prompt_token_ids=(1, 2, 3), output_token_ids=[7] * num_outputs)


def _token_ids(logits: torch.Tensor, rows: list[SamplingRow], generator_seed: int = 0) -> list[int]:
    batch = SamplingBatch.build(rows, logits.shape[1])
    return sample(logits, batch, torch.Generator().manual_seed(generator_seed)).token_ids


def _seeded_sequence(seed: int, num_positions: int) -> list[int]:
    logits = torch.zeros(1, VOCAB_SIZE)  # [1, vocab_size], a flat distribution
    params = SamplingParams(seed=seed)
    return [_token_ids(logits, [_row(params, position)])[0] for position in range(num_positions)]


def test_derive_seed_is_a_fixed_63_bit_function_of_seed_and_position() -> None:
    assert derive_seed(0, 0) == 6017775124710473527
    assert derive_seed(42, 7) == 793502930448478848
    assert derive_seed(2**63 - 1, 10**6) == 3622299607732562782
    assert all(0 <= derive_seed(seed, position) < 2**63 for seed in range(50) for position in range(50))


def test_same_seed_and_position_give_the_same_token_in_any_batch_and_row() -> None:
    logits = torch.randn(8, VOCAB_SIZE, generator=torch.Generator().manual_seed(0))  # [8, vocab_size]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    alone = _token_ids(logits[3:4], [_row(seeded, num_outputs=5)], generator_seed=1)
    neighbours = [
        _row(SamplingParams(temperature=0.0), 2),
        _row(SamplingParams(), 9),
        _row(SamplingParams(seed=99, top_k=10), 5),
        _row(SamplingParams(temperature=1.5, repetition_penalty=1.2, logprobs=3), 0),
    ]
    for index in range(len(neighbours) + 1):
        rows = [*neighbours[:index], _row(seeded, num_outputs=5), *neighbours[index:]]
        row_logits = torch.cat([logits[:index], logits[3:4], logits[index + 1 : 5]])  # [5, vocab_size]
        assert _token_ids(row_logits, rows, generator_seed=index + 7)[index] == alone[0]


def test_seeded_token_does_not_depend_on_the_engine_generator_state() -> None:
    logits = torch.zeros(1, VOCAB_SIZE)  # [1, vocab_size]
    rows = [_row(SamplingParams(seed=5), num_outputs=3)]
    batch = SamplingBatch.build(rows, VOCAB_SIZE)
    generator = torch.Generator().manual_seed(0)
    first = sample(logits, batch, generator).token_ids
    torch.rand(1000, generator=generator)
    assert sample(logits, batch, generator).token_ids == first
    assert sample(logits, batch, torch.Generator().manual_seed(77)).token_ids == first


def test_resuming_at_a_position_reproduces_the_original_tokens() -> None:
    sequence = _seeded_sequence(seed=3, num_positions=10)
    logits = torch.zeros(1, VOCAB_SIZE)  # [1, vocab_size]
    resumed = [_token_ids(logits, [_row(SamplingParams(seed=3), position)])[0] for position in (6, 7, 8, 9)]
    assert resumed == sequence[6:]


def test_different_seeds_give_different_tokens_on_a_flat_distribution() -> None:
    first = _seeded_sequence(seed=1, num_positions=20)
    second = _seeded_sequence(seed=2, num_positions=20)
    assert first != second
    assert sum(a == b for a, b in zip(first, second, strict=True)) <= 2
    assert len(set(first)) > 10  # the position moves the draw too


def test_seeded_sampling_across_seeds_matches_softmax() -> None:
    num_draws = 4000
    logits = torch.tensor([[0.5, -0.3, 1.2, 0.0]]).repeat(num_draws, 1)  # [num_draws, 4]
    rows = [_row(SamplingParams(seed=seed), num_outputs=0) for seed in range(num_draws)]
    observed = torch.bincount(torch.tensor(_token_ids(logits, rows)), minlength=4).double()  # [4]
    expected = logits[0].double().softmax(dim=0) * num_draws  # [4]
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 16.27  # 3 degrees of freedom, p = 0.001
