"""The counter-based draw: torch int64 ops give the pure-Python reference's bits, uniforms in (0, 1)."""

from __future__ import annotations

import math
import random

import torch

from services.engine.ops.counter_rng import (
    MASK64,
    counter_bits,
    counter_exponentials,
    derive_keys,
    derive_seed,
    to_int64,
    uniforms_from_bits_,
)
from services.engine.ops.reference import reference_bits, reference_exponential, reference_uniform

EDGE_KEYS = (0, 1, 2, 2**62, 2**63 - 2, 2**63 - 1, 2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1)
EDGE_SEEDS = (0, 1, 2**62, 2**63 - 2, 2**63 - 1)  # SamplingParams.seed is below 2^63


def _keys(values: list[int]) -> torch.Tensor:
    return torch.tensor([to_int64(value) for value in values], dtype=torch.int64)  # [num_keys]


def _unsigned(bits: torch.Tensor) -> list[list[int]]:
    return [[value & MASK64 for value in row] for row in bits.tolist()]


def test_tensor_bits_equal_the_python_reference_bit_for_bit() -> None:
    rng = random.Random(0)
    keys = [*EDGE_KEYS, *(rng.getrandbits(64) for _ in range(10))]
    vocab_size = 300
    bits = _unsigned(counter_bits(_keys(keys), vocab_size))  # [20, vocab_size], 6,000 pairs
    assert bits == [[reference_bits(key, token_id) for token_id in range(vocab_size)] for key in keys]


def test_tensor_bits_equal_the_reference_at_large_token_ids() -> None:
    keys = [2**63 - 1, 2**64 - 1]
    bits = _unsigned(counter_bits(_keys(keys), 200_000))  # [2, 200_000]
    for token_id in (0, 65_535, 151_935, 199_999):
        assert [row[token_id] for row in bits] == [reference_bits(key, token_id) for key in keys]


def test_tensor_keys_equal_derive_seed_for_seeds_near_the_top_of_the_range() -> None:
    rng = random.Random(1)
    pairs = [(seed, position) for seed in EDGE_SEEDS for position in (0, 1, 2, 1000, 10**6, 2**31 + 5)]
    pairs += [(rng.getrandbits(63), rng.randrange(1 << 20)) for _ in range(2000)]
    seeds = torch.tensor([seed for seed, _ in pairs], dtype=torch.int64)  # [num_pairs]
    positions = torch.tensor([position for _, position in pairs], dtype=torch.int64)  # [num_pairs]
    assert derive_keys(seeds, positions).tolist() == [derive_seed(seed, position) for seed, position in pairs]
    assert seeds.tolist() == [seed for seed, _ in pairs]  # the inputs are not changed in place


def test_uniforms_equal_the_reference_and_exponentials_round_like_it() -> None:
    seeds = torch.tensor([0, 7, 2**63 - 1], dtype=torch.int64)  # [3]
    positions = torch.tensor([0, 3, 10**6], dtype=torch.int64)  # [3]
    keys = [derive_seed(0, 0), derive_seed(7, 3), derive_seed(2**63 - 1, 10**6)]
    vocab_size = 500
    uniforms = uniforms_from_bits_(counter_bits(derive_keys(seeds, positions), vocab_size))  # [3, vocab_size]
    assert uniforms.tolist() == [[reference_uniform(key, v) for v in range(vocab_size)] for key in keys]
    expected = torch.tensor(
        [[reference_exponential(key, v) for v in range(vocab_size)] for key in keys], dtype=torch.float32
    )  # [3, vocab_size]
    q = counter_exponentials(seeds, positions, vocab_size)  # [3, vocab_size]
    assert q.dtype == torch.float32
    torch.testing.assert_close(q, expected, atol=0.0, rtol=2.0**-23)  # the float log: one float32 ulp


def test_uniforms_are_strictly_between_zero_and_one_even_for_extreme_bits() -> None:
    extremes = torch.tensor([0, -1, to_int64(2**63), 2**63 - 1, (1 << 12) - 1], dtype=torch.int64)  # [5]
    assert uniforms_from_bits_(extremes).tolist() == [2**-53, 1 - 2**-53, 0.5 + 2**-53, 0.5 - 2**-53, 2**-53]
    q = counter_exponentials(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)  # [64, 4096]
    assert bool(torch.isfinite(q).all()) and float(q.min()) > 0.0


def test_uniforms_are_uniform_by_kolmogorov_smirnov_and_chi_square() -> None:
    keys = derive_keys(torch.arange(32), torch.arange(32))  # [32]
    uniforms = uniforms_from_bits_(counter_bits(keys, 4096)).flatten()  # [131072]
    num_draws = uniforms.numel()
    assert float(uniforms.min()) > 0.0 and float(uniforms.max()) < 1.0
    ranks = torch.arange(1, num_draws + 1, dtype=torch.float64) / num_draws  # [num_draws]
    sorted_uniforms = uniforms.sort().values  # [num_draws]
    ks = max(float((ranks - sorted_uniforms).max()), float((sorted_uniforms - ranks + 1 / num_draws).max()))
    assert ks < 1.63 / math.sqrt(num_draws)  # p = 0.01
    observed = torch.bincount((uniforms * 64).long(), minlength=64).double()  # [64]
    chi_square = float(((observed - num_draws / 64) ** 2 / (num_draws / 64)).sum())
    assert chi_square < 103.4  # 63 degrees of freedom, p = 0.001
    neighbours = uniforms.view(32, 4096)  # [32, 4096]: adjacent token IDs are not correlated
    products = (neighbours[:, 1:] * neighbours[:, :-1]).mean()
    assert abs(float(products) - 0.25) < 0.003


def test_exponentials_have_mean_and_variance_one() -> None:
    q = counter_exponentials(torch.arange(16), torch.full((16,), 5), 8192).double()  # [16, 8192]
    assert abs(float(q.mean()) - 1.0) < 0.01
    assert abs(float(q.var()) - 1.0) < 0.03


def test_a_row_of_noise_depends_on_its_seed_and_position_only() -> None:
    seeds = torch.tensor([5, 5, 6, 5], dtype=torch.int64)  # [4]
    positions = torch.tensor([0, 1, 0, 0], dtype=torch.int64)  # [4]
    q = counter_exponentials(seeds, positions, 1000)  # [4, 1000]
    alone = counter_exponentials(seeds[1:2], positions[1:2], 1000)  # [1, 1000]
    assert torch.equal(q[0], q[3]) and torch.equal(q[1], alone[0])
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[0], q[2])
