"""Seeded sampling: a token is a function of (logits, params, seed, output position) only."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.common.sampling import SamplingParams
from services.engine.layers import sampler as sampler_module
from services.engine.layers.sampler import SamplingBatch, SamplingRow, compute_probs, sample
from services.engine.ops.counter_rng import derive_seed

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


def test_seeded_row_alone_equals_the_same_row_anywhere_in_a_mixed_batch_of_eight() -> None:
    vocab_size = 4096
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(8, vocab_size, generator=generator)  # [8, vocab_size]
    flat = torch.zeros(1, vocab_size)  # [1, vocab_size]: the token is the noise's argmin alone
    others = [
        SamplingParams(),
        SamplingParams(seed=11, top_k=50),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, seed=2**63 - 1),
        SamplingParams(top_p=0.9),
        SamplingParams(seed=0, min_p=0.05),
        SamplingParams(temperature=0.7, repetition_penalty=1.1),
    ]
    for seed, num_outputs in ((1234, 5), (2**63 - 2, 0), (0, 17)):
        seeded = _row(SamplingParams(temperature=0.8, seed=seed), num_outputs)
        for row_logits in (logits[:1], flat):
            alone = _token_ids(row_logits, [seeded], generator_seed=1)[0]
            for index in range(8):
                rows = [*(_row(p, i) for i, p in enumerate(others[:index])), seeded]
                rows += [_row(p, i) for i, p in enumerate(others[index:])]
                batch_logits = logits.clone()  # [8, vocab_size]
                batch_logits[index] = row_logits[0]
                assert _token_ids(batch_logits, rows, generator_seed=index)[index] == alone


def test_seeded_frequencies_over_20k_seeds_match_the_probabilities() -> None:
    num_draws = 20_000
    cases = [
        (torch.tensor([0.1, 0.2, 0.3, 0.4]).log(), SamplingParams(seed=0)),
        (torch.tensor([0.5, -0.3, 1.2, 0.0]), SamplingParams(temperature=0.6, top_k=3, seed=0)),
    ]
    for row_logits, params in cases:
        logits = row_logits.unsqueeze(0).repeat(num_draws, 1)  # [num_draws, 4]
        rows = [_row(replace(params, seed=seed), seed % 7) for seed in range(num_draws)]
        probs = compute_probs(logits[:1], SamplingBatch.build(rows[:1], 4))[0]  # [4]
        observed = torch.bincount(torch.tensor(_token_ids(logits, rows)), minlength=4) / num_draws  # [4]
        tolerance = 3.0 * (probs * (1 - probs) / num_draws).sqrt() + 1e-9  # [4], three standard deviations
        assert bool(((observed - probs).abs() <= tolerance).all()), (observed.tolist(), probs.tolist())
        assert float(observed[probs == 0].sum()) == 0.0  # top_k's dropped token is never drawn


def test_seeded_rows_use_no_torch_generator_and_leave_the_engine_generator_untouched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows = [_row(SamplingParams(seed=seed, top_p=0.9), seed) for seed in range(6)]
    batch = SamplingBatch.build(rows, VOCAB_SIZE)
    logits = torch.randn(6, VOCAB_SIZE, generator=torch.Generator().manual_seed(4))  # [6, vocab_size]
    generator = torch.Generator().manual_seed(9)
    state = generator.get_state()

    def no_generator(*args: object, **kwargs: object) -> None:
        raise AssertionError("a torch.Generator was created for seeded rows")

    monkeypatch.setattr(sampler_module.torch, "Generator", no_generator)
    first = sample(logits, batch, generator).token_ids
    monkeypatch.undo()
    assert torch.equal(generator.get_state(), state)
    assert sample(logits, batch, torch.Generator().manual_seed(10)).token_ids == first


def test_unseeded_rows_draw_from_the_engine_generator_as_if_the_seeded_rows_were_absent() -> None:
    logits = torch.zeros(4, VOCAB_SIZE)  # [4, vocab_size]
    unseeded = [_row(SamplingParams(), 1), _row(SamplingParams(temperature=0.5), 2)]
    seeded = [_row(SamplingParams(seed=8), 0), _row(SamplingParams(seed=9), 4)]
    mixed = _token_ids(logits, [seeded[0], unseeded[0], seeded[1], unseeded[1]], generator_seed=21)
    assert [mixed[1], mixed[3]] == _token_ids(logits[:2], unseeded, generator_seed=21)
    assert [mixed[0], mixed[2]] == _token_ids(logits[:2], seeded, generator_seed=22)
