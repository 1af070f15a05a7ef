"""Per-step sampler inputs: the rows of a step gathered into tensors, and the seed derivation.

`derive_seed(seed, position) = splitmix64(splitmix64(seed) ^ position) >> 1` (63 bits) is fixed
forever: it is what makes a seeded request reproducible across batches, preemptions and processes.
The sampler computes it on tensors (counter_rng.derive_keys) from `SeedTensors.seeds` and
`.positions`; this Python form is its reference.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from services.common.sampling import SamplingParams
from services.engine.layers.attention_metadata import to_device


@dataclass
class SamplingRow:
    """One sequence's input to a step. The token being sampled is output position len(output_token_ids)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    banned_token_ids: Sequence[int] = ()


@dataclass
class PenaltyTensors:
    """Penalty inputs of a step, as (row, token) index pairs into the logits."""

    repetition_penalties: Tensor  # [num_seqs]
    frequency_penalties: Tensor  # [num_seqs]
    presence_penalties: Tensor  # [num_seqs]
    seen_row_ids: Tensor  # [num_seen] distinct prompt-or-output tokens of rows with a repetition penalty
    seen_token_ids: Tensor  # [num_seen]
    counted_row_ids: Tensor  # [num_counted] distinct output tokens of rows with a frequency/presence penalty
    counted_token_ids: Tensor  # [num_counted]
    output_counts: Tensor  # [num_counted] float32, how often each counted token was output


@dataclass
class SeedTensors:
    """Which sampled rows of a step carry a seed, and the (seed, position) each draws its noise from."""

    seeded_ids: Tensor  # [num_seeded] int64, indices into the sampled rows
    unseeded_ids: Tensor  # [num_unseeded] int64, the other sampled rows: they use the engine's generator
    seeds: Tensor  # [num_seeded] int64, SamplingParams.seed (below 2^63)
    positions: Tensor  # [num_seeded] int64, the output position being sampled: len(output_token_ids)

    @property
    def num_seeded(self) -> int:
        return int(self.seeds.shape[0])

    @property
    def num_unseeded(self) -> int:
        return int(self.unseeded_ids.shape[0])


@dataclass
class AllowedTokens:
    """The tokens each row with a grammar may take this step, as a bitmask (grammar_mask.py fills it)."""

    row_ids: Tensor  # [num_masked] int64, the rows with a grammar, each once
    # [num_masked, ceil(vocab_size / 32)] int32: token v is allowed when bit v % 32 of word v // 32 is set
    bitmask: Tensor


@dataclass
class SamplingBatch:
    """Per-step sampler inputs, built once per step by `build`. Unused features are None."""

    num_seqs: int
    vocab_size: int
    sampled_row_ids: Tensor  # [num_sampled] int64, the rows that are not greedy
    seeds: SeedTensors | None  # None when no sampled row has a seed
    temperatures: Tensor  # [num_seqs] float32; unused for greedy rows
    top_ks: Tensor | None  # [num_seqs] int64, 0 = off; None when no sampled row uses top_k
    top_ps: Tensor | None  # [num_seqs] float32; None when no sampled row uses top_p
    min_ps: Tensor | None  # [num_seqs] float32; None when no sampled row uses min_p
    penalties: PenaltyTensors | None
    banned_row_ids: Tensor | None  # [num_banned] int64
    banned_token_ids: Tensor | None  # [num_banned] int64
    num_logprobs: list[int | None]  # per row, SamplingParams.logprobs
    max_top_k: int = 1  # the largest top_k in use, known on the host (no device read to size topk)
    allowed: AllowedTokens | None = None  # None when no row has a grammar

    @property
    def num_sampled(self) -> int:
        return int(self.sampled_row_ids.shape[0])

    @property
    def has_logprobs(self) -> bool:
        return any(k is not None for k in self.num_logprobs)

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        vocab_size: int,
        device: torch.device | str = "cpu",
        allowed: AllowedTokens | None = None,
    ) -> SamplingBatch:
        """Gather the step's per-row inputs into tensors on `device`, skipping features no row uses.
        `allowed` (already on `device`) covers the rows with a grammar."""
        if allowed is not None and allowed.bitmask.shape[1] * 32 < vocab_size:
            num_words = allowed.bitmask.shape[1]
            raise ValueError(f"a bitmask of {num_words} words does not cover {vocab_size} tokens")
        params = [row.params for row in rows]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        used = [params[i] for i in sampled]
        banned_row_ids = [i for i, row in enumerate(rows) for _ in row.banned_token_ids]
        banned_token_ids = [token_id for row in rows for token_id in row.banned_token_ids]
        uses_top_k = any(0 < p.top_k < vocab_size for p in used)
        return cls(
            num_seqs=len(rows),
            vocab_size=vocab_size,
            sampled_row_ids=_int64s(sampled, device),
            seeds=_build_seeds([rows[i] for i in sampled], device),
            temperatures=_float32s([p.temperature for p in params], device),
            top_ks=_int64s([p.top_k for p in params], device) if uses_top_k else None,
            top_ps=_float32s([p.top_p for p in params], device) if any(p.top_p < 1 for p in used) else None,
            min_ps=_float32s([p.min_p for p in params], device) if any(p.min_p > 0 for p in used) else None,
            penalties=_build_penalties(rows, device),
            banned_row_ids=_int64s(banned_row_ids, device) if banned_row_ids else None,
            banned_token_ids=_int64s(banned_token_ids, device) if banned_token_ids else None,
            num_logprobs=[p.logprobs for p in params],
            max_top_k=max((p.top_k for p in used if 0 < p.top_k < vocab_size), default=1),
            allowed=allowed,
        )


def _int64s(values: list[int], device: torch.device | str) -> Tensor:
    return to_device(values, device)  # [len(values)], queued without a host wait


def _float32s(values: list[float], device: torch.device | str) -> Tensor:
    return to_device(values, device, torch.float32)  # [len(values)], queued without a host wait


def _build_seeds(sampled_rows: Sequence[SamplingRow], device: torch.device | str) -> SeedTensors | None:
    """The seed tensors of the sampled rows, or None when none of them has a seed."""
    seeded_ids: list[int] = []
    unseeded_ids: list[int] = []
    seeds: list[int] = []
    positions: list[int] = []
    for i, row in enumerate(sampled_rows):
        if row.params.seed is None:
            unseeded_ids.append(i)
        else:
            seeded_ids.append(i)
            seeds.append(row.params.seed)
            positions.append(len(row.output_token_ids))
    if not seeds:
        return None
    return SeedTensors(
        seeded_ids=_int64s(seeded_ids, device),
        unseeded_ids=_int64s(unseeded_ids, device),
        seeds=_int64s(seeds, device),
        positions=_int64s(positions, device),
    )


def _build_penalties(rows: Sequence[SamplingRow], device: torch.device | str) -> PenaltyTensors | None:
    """Index pairs for the penalties, or None when no row has one."""
    params = [row.params for row in rows]
    repeats = [p.repetition_penalty != 1.0 for p in params]
    counts = [p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params]
    if not any(repeats) and not any(counts):
        return None
    seen_row_ids: list[int] = []
    seen_token_ids: list[int] = []
    counted_row_ids: list[int] = []
    counted_token_ids: list[int] = []
    output_counts: list[float] = []
    for i, row in enumerate(rows):
        if repeats[i]:
            seen = set(row.prompt_token_ids).union(row.output_token_ids)
            seen_row_ids.extend([i] * len(seen))
            seen_token_ids.extend(seen)
        if counts[i]:
            counter = Counter(row.output_token_ids)
            counted_row_ids.extend([i] * len(counter))
            counted_token_ids.extend(counter.keys())
            output_counts.extend(float(count) for count in counter.values())
    return PenaltyTensors(
        repetition_penalties=_float32s([p.repetition_penalty for p in params], device),
        frequency_penalties=_float32s([p.frequency_penalty for p in params], device),
        presence_penalties=_float32s([p.presence_penalty for p in params], device),
        seen_row_ids=_int64s(seen_row_ids, device),
        seen_token_ids=_int64s(seen_token_ids, device),
        counted_row_ids=_int64s(counted_row_ids, device),
        counted_token_ids=_int64s(counted_token_ids, device),
        output_counts=_float32s(output_counts, device),
    )
