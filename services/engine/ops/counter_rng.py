"""Counter-based random draws for seeded sampling: integers that are the same on every device.

A seeded row's noise is a pure function of (seed, position, token ID), computed with torch int64
ops only, so one vectorised call serves every seeded row of a step, on any device, with no
`torch.Generator` and no host sync:

    key  = derive_seed(seed, position) = splitmix64(splitmix64(seed) ^ position) >> 1
    bits = splitmix64(key + token_id * GAMMA)      # mod 2^64: output token_id of a splitmix64 stream
    u    = ((bits >> 12) + 0.5) / 2^52             # 52 high bits -> exactly (2k+1) / 2^53, in (0, 1)
    q    = float32(-log(u))                        # Exp(1), computed in float64

splitmix64 (Steele, Lea and Flood, 2014) adds GAMMA and then mixes, so `bits` is the token_id-th
output of the splitmix64 generator started at `key`; distinct keys start at unrelated places of its
2^64 period. torch int64 addition and multiplication wrap modulo 2^64 like the unsigned arithmetic
they stand for, and `>>` on int64 is arithmetic, so logical shifts mask the sign bits off.

What is exact: `bits` and `u` are the same integers and float64 values on every device and in any
batch (tested bit for bit against the pure-Python reference below). `log` is elementwise, so on one
device a row's q does not depend on the rest of the batch either. What is not: `log` is a
floating-point function whose last float64 bit differs between implementations (CUDA's, ATen's CPU
vector code, Python's math.log); rounding q to float32 hides almost all of that, but the sampler's
probabilities and argmax also round on their own device. So CUDA and CPU tokens for one seed are
usually, not provably, equal.
"""

from __future__ import annotations

import torch
from torch import Tensor

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment, 2^64 / golden ratio
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
NUM_UNIFORM_BITS = 52
_ONE_BITS = 0x3FF0000000000000  # the float64 1.0: sign 0, exponent 1023, mantissa 0


def to_int64(value: int) -> int:
    """The signed int64 with the same 64 bits as unsigned `value`, for building int64 tensors."""
    value &= MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def splitmix64(value: int) -> int:
    """The splitmix64 step on a 64-bit unsigned Python int: add GAMMA, then mix. Reference."""
    z = (value + GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & MASK64
    return z ^ (z >> 31)


def derive_seed(seed: int, position: int) -> int:
    """The 63-bit counter key for output `position` of a request seeded with `seed`. Fixed forever."""
    return splitmix64(splitmix64(seed) ^ position) >> 1


def splitmix64_(values: Tensor) -> Tensor:
    """In place on int64 `values` (any shape): the splitmix64 step of each, as signed int64 bits."""
    return _mix64_(values.add_(to_int64(GAMMA)))


def _mix64_(values: Tensor) -> Tensor:
    """In place: splitmix64's finaliser (the step without its GAMMA increment)."""
    shifted = torch.empty_like(values)  # same shape as values
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        torch.bitwise_right_shift(values, shift, out=shifted)
        shifted.bitwise_and_((1 << (64 - shift)) - 1)  # a logical shift: the sign copies cleared
        values.bitwise_xor_(shifted)
        if multiplier is not None:
            values.mul_(to_int64(multiplier))
    return values


def derive_keys(seeds: Tensor, positions: Tensor) -> Tensor:
    """`derive_seed` on int64 tensors: seeds [num_rows] in [0, 2^63), positions [num_rows] >= 0."""
    keys = splitmix64_(seeds.to(torch.int64, copy=True))  # [num_rows]
    keys.bitwise_xor_(positions)
    splitmix64_(keys)
    return keys.bitwise_right_shift_(1).bitwise_and_((1 << 63) - 1)  # [num_rows], 63 bits


def counter_bits(keys: Tensor, vocab_size: int) -> Tensor:
    """The random bits [num_rows, vocab_size] int64 of every token ID under each of `keys` [num_rows]."""
    increments = torch.arange(1, vocab_size + 1, dtype=torch.int64, device=keys.device)  # [vocab_size]
    increments.mul_(to_int64(GAMMA))  # (token_id + 1) * GAMMA: splitmix64's own increment folded in
    bits = keys.to(torch.int64).unsqueeze(1) + increments  # [num_rows, vocab_size]
    return _mix64_(bits)


def uniforms_from_bits_(bits: Tensor) -> Tensor:
    """In place: int64 bits -> float64 uniforms (2k+1) / 2^53 in (0, 1), k the 52 high bits.

    The 52 bits become the mantissa of a float64 in [1, 2), 1 + k / 2^52; subtracting 1 - 2^-53 is
    exact (Sterbenz), so no rounding happens on any device. Returns a float64 view of `bits`.
    """
    bits.bitwise_right_shift_(64 - NUM_UNIFORM_BITS)
    bits.bitwise_and_((1 << NUM_UNIFORM_BITS) - 1)
    bits.bitwise_or_(_ONE_BITS)
    return bits.view(torch.float64).sub_(1.0 - 2.0**-53)


def counter_exponentials(seeds: Tensor, positions: Tensor, vocab_size: int) -> Tensor:
    """Exp(1) noise [num_rows, vocab_size] float32 for rows seeded with `seeds` at `positions`.

    seeds, positions: [num_rows] int64 on the device the noise is wanted on. Row r, column v is a
    function of (seeds[r], positions[r], v) only: not of the row's index or of the other rows.
    """
    uniforms = uniforms_from_bits_(counter_bits(derive_keys(seeds, positions), vocab_size))
    return uniforms.log_().neg_().to(torch.float32)  # [num_rows, vocab_size]
