"""The batched sampler: greedy, filters, penalties, bans, logprobs and the sampled distribution."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
import torch

from services.common.sampling import SamplingParams
from services.engine.layers.sampler import SamplerOutput, SamplingBatch, SamplingRow, compute_probs, sample

GREEDY = SamplingParams(temperature=0.0)


def _row(
    params: SamplingParams,
    prompt: Sequence[int] = (0,),
    output: Sequence[int] = (),
    banned: Sequence[int] = (),
) -> SamplingRow:
    return SamplingRow(
        params=params, prompt_token_ids=prompt, output_token_ids=output, banned_token_ids=banned
    )


def _sample(logits: torch.Tensor, rows: list[SamplingRow], generator_seed: int = 0) -> SamplerOutput:
    batch = SamplingBatch.build(rows, logits.shape[1])
    return sample(logits, batch, torch.Generator().manual_seed(generator_seed))


def _probs(logits: list[float], row: SamplingRow) -> torch.Tensor:
    logits_tensor = torch.tensor([logits])  # [1, vocab_size]
    return compute_probs(logits_tensor, SamplingBatch.build([row], len(logits)))[0]  # [vocab_size]


def test_greedy_equals_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))  # [8, 50]
    out = _sample(logits, [_row(GREEDY) for _ in range(8)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None


def test_greedy_rows_are_unaffected_by_other_rows_params() -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2))  # [6, 40]
    others = [
        SamplingParams(temperature=0.3, top_k=3, seed=5),
        SamplingParams(top_p=0.5, min_p=0.2, repetition_penalty=1.5, frequency_penalty=1.0),
        SamplingParams(temperature=1.7, presence_penalty=-2.0, logprobs=4),
    ]
    rows = [_row(GREEDY), _row(others[0], output=(3,)), _row(GREEDY), _row(others[1], output=(4, 4))]
    rows += [_row(others[2], output=(5,)), _row(GREEDY, banned=(1,))]
    out = _sample(logits, rows)
    expected = logits.argmax(dim=-1)  # [6]
    assert [out.token_ids[i] for i in (0, 2)] == [int(expected[0]), int(expected[2])]
    assert out.token_ids[5] == _sample(logits[5:], [rows[5]]).token_ids[0]


def test_top_k_one_behaves_like_greedy() -> None:
    logits = torch.randn(16, 30, generator=torch.Generator().manual_seed(3))  # [16, 30]
    for generator_seed in range(5):
        out = _sample(logits, [_row(SamplingParams(top_k=1)) for _ in range(16)], generator_seed)
        assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_most_likely_token() -> None:
    logits = [0.1, 2.0, 1.9, -1.0]
    assert _probs(logits, _row(SamplingParams(top_p=1e-6))).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_it() -> None:
    logits = [math.log(p) for p in (0.1, 0.4, 0.3, 0.2)]
    probs = _probs(logits, _row(SamplingParams(top_p=0.65)))  # 0.4 + 0.3 reaches 0.65
    torch.testing.assert_close(probs, torch.tensor([0.0, 4 / 7, 3 / 7, 0.0]))


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely() -> None:
    logits = [math.log(p) for p in (0.5, 0.3, 0.1, 0.06, 0.04)]
    probs = _probs(logits, _row(SamplingParams(min_p=0.15)))  # threshold 0.075
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.1, 0.0, 0.0]) / 0.9)


def test_repetition_penalty_lowers_repeated_positive_and_negative_logits() -> None:
    logits = [2.0, -1.0, 0.5, 3.0]
    row = _row(SamplingParams(repetition_penalty=2.0), prompt=(0,), output=(1, 1))
    expected = torch.tensor([1.0, -2.0, 0.5, 3.0]).softmax(dim=0)  # [4]
    torch.testing.assert_close(_probs(logits, row), expected)


def test_repetition_penalty_below_one_raises_repeated_logits() -> None:
    row = _row(SamplingParams(repetition_penalty=0.5), prompt=(0, 1), output=())
    expected = torch.tensor([4.0, -0.5, 0.5, 3.0]).softmax(dim=0)  # [4]
    torch.testing.assert_close(_probs([2.0, -1.0, 0.5, 3.0], row), expected)


def test_frequency_and_presence_penalties_match_a_hand_calculation() -> None:
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    row = _row(params, prompt=(1,), output=(0, 0, 2, 0))
    # token 0: 1 - 0.5 * 3 - 0.25; token 2: 1 - 0.5 - 0.25; token 1 is only in the prompt.
    expected = torch.tensor([-0.75, 1.0, 0.25, 1.0, 1.0]).softmax(dim=0)  # [5]
    torch.testing.assert_close(_probs([1.0] * 5, row), expected, atol=0.0, rtol=0.0)


def test_banned_tokens_are_never_picked_while_below_min_tokens() -> None:
    eos_token_id = 3
    logits = torch.tensor([[0.0, 0.0, 0.0, 20.0]]).repeat(64, 1)  # [64, 4]
    rows = [_row(GREEDY, banned=(eos_token_id,))]
    rows += [_row(SamplingParams(min_tokens=2), banned=(eos_token_id,)) for _ in range(63)]
    out = _sample(logits, rows)
    assert eos_token_id not in out.token_ids
    assert _sample(logits[:1], [_row(GREEDY)]).token_ids == [eos_token_id]


def test_chosen_logprob_is_log_softmax_of_the_raw_logits() -> None:
    logits = torch.randn(4, 20, generator=torch.Generator().manual_seed(4))  # [4, 20]
    params = SamplingParams(temperature=0.6, top_k=5, repetition_penalty=1.4, logprobs=0)
    rows = [_row(params, output=(1, 2)), _row(GREEDY), _row(params, banned=(0,)), _row(GREEDY)]
    out = _sample(logits, rows)
    raw_logprobs = logits.log_softmax(dim=-1)  # [4, 20]
    expected = [float(raw_logprobs[i, token_id]) for i, token_id in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(expected, abs=1e-6)
    assert out.top_logprobs == [[], [], [], []]


def test_top_logprobs_are_sorted_and_have_length_k_for_rows_that_asked() -> None:
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(5))  # [3, 30]
    rows = [_row(SamplingParams(logprobs=5)), _row(GREEDY), _row(SamplingParams(logprobs=20))]
    out = _sample(logits, rows)
    assert out.top_logprobs is not None
    assert [len(top) for top in out.top_logprobs] == [5, 0, 20]
    raw_logprobs = logits.log_softmax(dim=-1)  # [3, 30]
    for i in (0, 2):
        values = [value for _, value in out.top_logprobs[i]]
        assert values == sorted(values, reverse=True)
        top_ids = raw_logprobs[i].topk(len(values)).indices.tolist()
        assert [token_id for token_id, _ in out.top_logprobs[i]] == top_ids
        assert values == pytest.approx(raw_logprobs[i, top_ids].tolist(), abs=1e-6)


def test_unseeded_sampling_at_temperature_one_matches_softmax() -> None:
    num_draws = 20_000
    logits = torch.tensor([[0.5, -0.3, 1.2, 0.0]]).repeat(num_draws, 1)  # [num_draws, 4]
    out = _sample(logits, [_row(SamplingParams()) for _ in range(num_draws)], generator_seed=11)
    observed = torch.bincount(torch.tensor(out.token_ids), minlength=4).double()  # [4]
    expected = logits[0].double().softmax(dim=0) * num_draws  # [4]
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 16.27  # 3 degrees of freedom, p = 0.001


def test_sample_leaves_the_callers_logits_unchanged() -> None:
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(6))  # [2, 10]
    before = logits.clone()  # [2, 10]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, top_p=0.5, logprobs=2)
    _sample(logits, [_row(params, output=(1, 2)), _row(GREEDY, banned=(3,))])
    assert torch.equal(logits, before)


def test_logits_that_do_not_match_the_batch_are_rejected() -> None:
    batch = SamplingBatch.build([_row(GREEDY)], vocab_size=10)
    with pytest.raises(ValueError, match="do not match"):
        sample(torch.zeros(1, 11), batch, torch.Generator())


def test_greedy_batch_builds_no_filter_or_penalty_tensors() -> None:
    rows = [_row(SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.1)) for _ in range(32)]
    batch = SamplingBatch.build(rows, vocab_size=100)
    assert batch.num_sampled == 0
    assert batch.top_ks is None and batch.top_ps is None and batch.min_ps is None
    assert batch.penalties is None and batch.banned_row_ids is None and not batch.has_logprobs


def test_the_gpu_top_p_path_keeps_the_same_tokens_as_the_candidate_path() -> None:
    """A GPU sorts every row in full (no read-back to find short rows); on the CPU the candidate search
    with its fallback runs. Both must keep the same set, here for peaked and for flat rows."""
    from services.engine.layers.sampler import _mask_top_p_

    torch.manual_seed(0)
    peaked = torch.randn(6, 1000) * 8  # [6, 1000]: the mass sits in a few candidates
    flat = torch.randn(6, 1000) * 0.01  # [6, 1000]: 256 candidates hold far less than top_p
    top_ps = torch.tensor([0.05, 0.5, 0.9, 0.99, 1.0, 0.7])  # [6]
    for logits in (peaked, flat):
        by_candidates, by_sort = logits.clone(), logits.clone()
        _mask_top_p_(by_candidates, top_ps, full_sort=False)
        _mask_top_p_(by_sort, top_ps, full_sort=True)
        assert torch.equal(by_candidates.isinf(), by_sort.isinf())
        assert not by_sort[4].isinf().any()
