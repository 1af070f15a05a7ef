"""A slow, per-row reference for the sampler, written independently of sampler.py.

Plain Python loops and sorting over one row; torch only for the row's storage (float32, so element
values round like the fast path's) and for softmax. Tests check that `compute_probs` agrees with
`reference_sample_probs`, and that `sample` picks the token `reference_sample_token` picks for greedy
and seeded rows, whose noise comes from the pure-Python counter hash (counter_rng.reference_*).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch
from torch import Tensor

from services.common.sampling import SamplingParams
from services.engine.counter_rng import reference_exponential
from services.engine.sampling_batch import derive_seed


def reference_sample_probs(
    logits_row: Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    banned_token_ids: Sequence[int] = (),
    allowed_token_ids: Collection[int] | None = None,
) -> Tensor:
    """The probability vector [vocab_size] one row samples from; one-hot at the argmax when greedy.
    `allowed_token_ids`: a grammar's next tokens (None: no grammar)."""
    row = logits_row.detach().to(dtype=torch.float32, device="cpu").clone()  # [vocab_size]
    for token_id in set(prompt_ids) | set(output_ids):
        value = float(row[token_id])
        penalty = params.repetition_penalty
        row[token_id] = value / penalty if value > 0 else value * penalty
    for token_id in set(output_ids):
        count = output_ids.count(token_id)
        row[token_id] = float(row[token_id]) - params.frequency_penalty * count - params.presence_penalty
    for token_id in banned_token_ids:
        row[token_id] = -math.inf
    if allowed_token_ids is not None:
        for token_id in range(len(row)):
            if token_id not in allowed_token_ids:
                row[token_id] = -math.inf
    values = row.tolist()
    if params.is_greedy:
        probs = torch.zeros_like(row)  # [vocab_size]
        probs[values.index(max(values))] = 1.0
        return probs
    row = row / params.temperature  # [vocab_size]
    keep = [True] * len(values)
    if params.top_k > 0:
        _keep_top_k(row.tolist(), params.top_k, keep)
    if params.top_p < 1.0:
        _keep_top_p(_masked_softmax(row, keep), params.top_p, keep)
    if params.min_p > 0.0:
        probs_list = _masked_softmax(row, keep)
        threshold = max(probs_list) * params.min_p
        for token_id, prob in enumerate(probs_list):
            if prob < threshold:
                keep[token_id] = False
    return torch.tensor(_masked_softmax(row, keep), dtype=torch.float32)  # [vocab_size]


def reference_sample_token(
    logits_row: Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    banned_token_ids: Sequence[int] = (),
    allowed_token_ids: Collection[int] | None = None,
) -> int:
    """The token a greedy or seeded row picks: argmax(probs / q), q[v] the counter draw for v.

    Unseeded sampled rows draw from the engine's generator, which has no reference: ValueError.
    """
    probs = reference_sample_probs(
        logits_row, params, prompt_ids, output_ids, banned_token_ids, allowed_token_ids
    )
    if params.is_greedy:
        return int(probs.argmax())
    if params.seed is None:
        raise ValueError("an unseeded sampled row has no reference token")
    key = derive_seed(params.seed, len(output_ids))
    q = torch.tensor(
        [reference_exponential(key, token_id) for token_id in range(len(probs))], dtype=torch.float32
    )  # [vocab_size]
    return int((probs / q).argmax())


def _masked_softmax(row: Tensor, keep: list[bool]) -> list[float]:
    """Softmax over the kept entries of `row`; dropped entries get 0."""
    masked = row.clone()  # [vocab_size]
    for token_id, is_kept in enumerate(keep):
        if not is_kept:
            masked[token_id] = -math.inf
    return masked.softmax(dim=0).tolist()


def _keep_top_k(values: list[float], top_k: int, keep: list[bool]) -> None:
    """Drop every value below the k-th largest (ties with it stay)."""
    if top_k >= len(values):
        return
    kth_value = sorted(values, reverse=True)[top_k - 1]
    for token_id, value in enumerate(values):
        if value < kth_value:
            keep[token_id] = False


def _keep_top_p(probs: list[float], top_p: float, keep: list[bool]) -> None:
    """Walk tokens from most to least likely; drop each one reached after the mass hits top_p."""
    mass_before = 0.0
    for rank, token_id in enumerate(sorted(range(len(probs)), key=lambda i: -probs[i])):
        if rank > 0 and mass_before >= top_p:
            keep[token_id] = False
        mass_before += probs[token_id]
