"""The batched sampler: one call picks the next token of every running sequence.

Pipeline, per row (ops/reference.py's sampler twin implements the same steps one row at a time):

1. Penalties. The repetition penalty divides the logit of every token seen in the prompt or the output
   by the penalty when positive and multiplies it otherwise; then each output token's logit is lowered
   by `frequency_penalty * count + presence_penalty`.
2. Bans. `SamplingRow.banned_token_ids` (EOS and stop tokens while below min_tokens) become -inf. Then
   the grammar mask: in a row with a grammar (`SamplingBatch.allowed`), every token the grammar does not
   allow next becomes -inf, the columns past the tokenizer's vocabulary among them.
3. Greedy rows (temperature < 1e-5) take the argmax of these logits; their filters are ignored.
4. Other rows: divide by the temperature; keep the top_k largest logits (ties with the k-th kept);
   keep the smallest set of most likely tokens whose probability reaches top_p, measured after top_k;
   drop tokens whose probability is below min_p times the largest; softmax.
5. Exponential race: token = argmax(probs / q) with q ~ Exp(1) i.i.d. per vocab entry, an exact draw
   from probs.

Seeding: a row with a seed draws its q from the counter-based generator of counter_rng.py, not from
generator state: q[v] = -log(u), u a 52-bit uniform hashed from (derive_seed(seed, position), v), where
position is the index of the output token being sampled (`len(output_token_ids)`) and
`derive_seed(seed, position) = splitmix64(splitmix64(seed) ^ position) >> 1`. Every seeded row of a step
goes through one vectorised call of int64 tensor ops on the logits' device: no torch.Generator, no loop
over rows, no host sync. So a seeded row's token is a function of its logits, params, seed and position
only: not of batch composition, row index, batch size, preemption, the prefill-to-decode handoff or the
process. The hash's integers are the same on every device; the float log, softmax and argmax round on
each device, so CPU and CUDA tokens for one seed usually agree, which is not promised. Rows without a
seed draw from the engine's `generator`.

Logprobs are log_softmax of the raw model logits, before penalties, temperature and filtering, like
vLLM v1's default. They are computed only when some row asks; then `SamplerOutput.logprobs` holds the
chosen token's logprob for every row, and `top_logprobs` the k most likely (token ID, logprob) pairs,
most likely first, for rows that asked for k > 0 and [] for the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from services.engine.layers.sampling_batch import (
    AllowedTokens,
    PenaltyTensors,
    SamplingBatch,
    SamplingRow,
    SeedTensors,
)
from services.engine.ops.counter_rng import counter_exponentials, derive_seed

# top_p looks for its cut among this many most likely tokens first; a full sort is the fallback.
_NUM_TOP_P_CANDIDATES = 256

__all__ = [
    "AllowedTokens",
    "DeviceSample",
    "PenaltyTensors",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingRow",
    "SeedTensors",
    "compute_probs",
    "derive_seed",
    "sample",
    "sample_on_device",
]


@dataclass
class SamplerOutput:
    """One step's result per row. Logprobs are of the raw logits; None when no row asked for them."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


@dataclass
class DeviceSample:
    """One step's picks as tensors where they were computed: `to_host` reads them into a SamplerOutput."""

    token_ids: Tensor  # [num_seqs] int64
    logprobs: Tensor | None  # [num_seqs] the chosen tokens' logprobs; None when no row asked
    top_values: Tensor | None  # [num_seqs, max_k] the most likely logprobs; None when no row asked for k > 0
    top_ids: Tensor | None  # [num_seqs, max_k]
    num_logprobs: list[int | None]

    def copy_to_host(self) -> DeviceSample:
        """The same picks, copying to pinned host memory without waiting (the caller records an event
        to wait on); on a CPU, itself."""
        if self.token_ids.device.type == "cpu":
            return self

        def move(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to("cpu", non_blocking=True)

        token_ids = self.token_ids.to("cpu", non_blocking=True)
        return DeviceSample(
            token_ids, move(self.logprobs), move(self.top_values), move(self.top_ids), self.num_logprobs
        )

    def to_host(self) -> SamplerOutput:
        token_ids = self.token_ids.tolist()
        if self.logprobs is None:
            return SamplerOutput(token_ids=token_ids, logprobs=None, top_logprobs=None)
        top_logprobs: list[list[tuple[int, float]]] = [[] for _ in self.num_logprobs]
        if self.top_values is not None and self.top_ids is not None:
            values, ids = self.top_values.tolist(), self.top_ids.tolist()
            for i, k in enumerate(self.num_logprobs):
                if k:
                    top_logprobs[i] = list(zip(ids[i][:k], values[i][:k], strict=True))
        return SamplerOutput(token_ids=token_ids, logprobs=self.logprobs.tolist(), top_logprobs=top_logprobs)


def sample(logits: Tensor, batch: SamplingBatch, generator: torch.Generator) -> SamplerOutput:
    """Pick one token per row of `logits` [num_seqs, vocab_size]. `generator` serves unseeded rows."""
    return sample_on_device(logits, batch, generator).to_host()


def sample_on_device(logits: Tensor, batch: SamplingBatch, generator: torch.Generator) -> DeviceSample:
    """`sample` without reading anything back: the picks stay on the logits' device."""
    _check_logits(logits, batch)
    logits = logits.float()  # [num_seqs, vocab_size]
    penalised = _penalise(logits, batch)  # [num_seqs, vocab_size]
    token_ids = penalised.argmax(dim=-1)  # [num_seqs]
    if batch.num_sampled > 0:
        probs = _filtered_probs(penalised, batch)  # [num_sampled, vocab_size]
        q = _exponentials(batch, probs.device, generator)  # [num_sampled, vocab_size]
        token_ids[batch.sampled_row_ids] = (probs / q).argmax(dim=-1)
    if not batch.has_logprobs:
        return DeviceSample(token_ids, None, None, None, batch.num_logprobs)
    return _gather_logprobs(logits, token_ids, batch.num_logprobs)


def compute_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The distribution each row samples from: one-hot at the argmax for greedy rows. For tests."""
    _check_logits(logits, batch)
    penalised = _penalise(logits.float(), batch)  # [num_seqs, vocab_size]
    probs = torch.zeros_like(penalised)  # [num_seqs, vocab_size]
    probs.scatter_(1, penalised.argmax(dim=-1, keepdim=True), 1.0)
    if batch.num_sampled > 0:
        probs[batch.sampled_row_ids] = _filtered_probs(penalised, batch)
    return probs


def _check_logits(logits: Tensor, batch: SamplingBatch) -> None:
    if tuple(logits.shape) != (batch.num_seqs, batch.vocab_size):
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} do not match the batch "
            f"({batch.num_seqs} rows, vocab_size {batch.vocab_size})"
        )


def _penalise(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """Steps 1 and 2: penalties, then bans and the grammar mask. Returns a new tensor when anything
    changes."""
    penalties = batch.penalties
    if penalties is None and batch.banned_row_ids is None and batch.allowed is None:
        return logits
    logits = logits.clone()  # [num_seqs, vocab_size]
    if penalties is not None:
        row_ids, token_ids = penalties.seen_row_ids, penalties.seen_token_ids
        seen = logits[row_ids, token_ids]  # [num_seen]
        repetition = penalties.repetition_penalties[row_ids]  # [num_seen]
        logits[row_ids, token_ids] = torch.where(seen > 0, seen / repetition, seen * repetition)
        row_ids, token_ids = penalties.counted_row_ids, penalties.counted_token_ids
        logits[row_ids, token_ids] -= (
            penalties.frequency_penalties[row_ids] * penalties.output_counts
            + penalties.presence_penalties[row_ids]
        )  # [num_counted]
    if batch.banned_row_ids is not None and batch.banned_token_ids is not None:
        logits[batch.banned_row_ids, batch.banned_token_ids] = float("-inf")
    if batch.allowed is not None:
        _mask_disallowed_(logits, batch.allowed)
    return logits


def _mask_disallowed_(logits: Tensor, allowed: AllowedTokens) -> None:
    """In place: -inf for every token a grammar row's bitmask does not allow.

    The int32 words are read as little-endian bytes (byte k of word w holds tokens 32w + 8k ..), and each
    byte looks up its 8 tokens' additive bias (0 or -inf) in a 256-row table: one gather and one add,
    several times faster on a CPU than unpacking bits into a boolean mask and filling with it."""
    device, num_masked, vocab_size = logits.device, allowed.row_ids.shape[0], logits.shape[1]
    byte_values = torch.arange(256, device=device).unsqueeze(1)  # [256, 1]
    is_set = (byte_values >> torch.arange(8, device=device)) & 1  # [256, 8]
    table = torch.zeros((256, 8), dtype=logits.dtype, device=device)  # [256, 8]
    table.masked_fill_(is_set == 0, float("-inf"))
    as_bytes = allowed.bitmask.contiguous().view(torch.uint8).flatten().long()  # [num_masked * 4 * num_words]
    bias = table.index_select(0, as_bytes).view(num_masked, -1)[:, :vocab_size]  # [num_masked, vocab_size]
    logits.index_add_(0, allowed.row_ids, bias)


def _filtered_probs(penalised: Tensor, batch: SamplingBatch) -> Tensor:
    """Step 4 for the sampled rows: temperature, top_k, top_p, min_p, softmax."""
    row_ids = batch.sampled_row_ids
    logits = penalised if batch.num_sampled == batch.num_seqs else penalised[row_ids]
    logits = logits / batch.temperatures[row_ids].unsqueeze(1)  # [num_sampled, vocab_size]
    if batch.top_ks is not None:
        _mask_top_k_(logits, batch.top_ks[row_ids], batch.max_top_k)
    if batch.top_ps is not None:
        _mask_top_p_(logits, batch.top_ps[row_ids])
    if batch.min_ps is not None:
        _mask_min_p_(logits, batch.min_ps[row_ids])
    return logits.softmax(dim=-1)  # [num_sampled, vocab_size]


def _mask_top_k_(logits: Tensor, top_ks: Tensor, max_k: int) -> None:
    """In place: keep logits at least the k-th largest of their row; k of 0 or >= vocab keeps all.
    `max_k`: the largest k in use, from the host, so sizing the top-k reads nothing back from a GPU."""
    is_on = (top_ks > 0) & (top_ks < logits.shape[1])  # [num_rows]
    ks = torch.where(is_on, top_ks, torch.ones_like(top_ks))  # [num_rows]
    top_values = logits.topk(max_k, dim=-1).values  # [num_rows, max_k]
    kth_values = top_values.gather(1, (ks - 1).unsqueeze(1))  # [num_rows, 1]
    kth_values = kth_values.masked_fill(~is_on.unsqueeze(1), float("-inf"))  # [num_rows, 1]
    logits.masked_fill_(logits < kth_values, float("-inf"))


def _mask_top_p_(logits: Tensor, top_ps: Tensor, full_sort: bool | None = None) -> None:
    """In place: keep the most likely tokens until their mass reaches top_p; 1.0 keeps all.

    On a CPU the cut is looked for among each row's most likely _NUM_TOP_P_CANDIDATES tokens, and by a
    full sort only for rows whose candidates hold less than top_p: both give the same set, and which one
    a row takes depends on that row alone. On a GPU every row is sorted in full: finding the short rows
    would read a mask back to the host, a wait in the middle of the step.
    """
    vocab_size = logits.shape[1]
    probs = logits.softmax(dim=-1)  # [num_rows, vocab_size]
    is_filtered = top_ps < 1.0  # [num_rows]
    if logits.device.type != "cpu" if full_sort is None else full_sort:
        sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)  # [num_rows, vocab_size]
        keep = _nucleus(sorted_probs, sorted_ids, top_ps, vocab_size)[0] | ~is_filtered.unsqueeze(1)
        logits.masked_fill_(~keep, float("-inf"))
        return
    num_candidates = min(_NUM_TOP_P_CANDIDATES, vocab_size)
    candidate_probs, candidate_ids = probs.topk(num_candidates, dim=-1)  # [num_rows, num_candidates]
    keep, candidate_mass = _nucleus(candidate_probs, candidate_ids, top_ps, vocab_size)
    short_row_ids = ((candidate_mass < top_ps) & is_filtered).nonzero().squeeze(1)  # [num_short]
    if short_row_ids.numel() > 0:
        short_probs = probs[short_row_ids]  # [num_short, vocab_size]
        sorted_probs, sorted_ids = short_probs.sort(dim=-1, descending=True)  # [num_short, vocab_size]
        keep[short_row_ids] = _nucleus(sorted_probs, sorted_ids, top_ps[short_row_ids], vocab_size)[0]
    keep |= ~is_filtered.unsqueeze(1)
    logits.masked_fill_(~keep, float("-inf"))


def _nucleus(
    sorted_probs: Tensor, sorted_ids: Tensor, top_ps: Tensor, vocab_size: int
) -> tuple[Tensor, Tensor]:
    """The keep mask [num_rows, vocab_size] and the total mass [num_rows] of sorted candidates.

    Candidates come most likely first; one is kept while the mass before it is below top_p (the
    first's is exactly 0, so it always stays). Tokens that are not candidates are dropped.
    """
    mass = sorted_probs.cumsum(dim=-1)  # [num_rows, num_sorted]
    sorted_keep = (mass - sorted_probs) < top_ps.unsqueeze(1)  # [num_rows, num_sorted]
    keep = torch.zeros(
        (sorted_probs.shape[0], vocab_size), dtype=torch.bool, device=sorted_probs.device
    )  # [num_rows, vocab_size]
    return keep.scatter_(1, sorted_ids, sorted_keep), mass[:, -1]


def _mask_min_p_(logits: Tensor, min_ps: Tensor) -> None:
    """In place: drop tokens whose probability is below min_p times their row's largest."""
    probs = logits.softmax(dim=-1)  # [num_rows, vocab_size]
    thresholds = probs.amax(dim=-1, keepdim=True) * min_ps.unsqueeze(1)  # [num_rows, 1]
    logits.masked_fill_(probs < thresholds, float("-inf"))


def _exponentials(batch: SamplingBatch, device: torch.device, generator: torch.Generator) -> Tensor:
    """Exp(1) noise per sampled row: counter-based from its (seed, position), else from `generator`."""
    shape = (batch.num_sampled, batch.vocab_size)
    seeds = batch.seeds
    if seeds is None:
        q = torch.empty(shape, device=device).exponential_(generator=generator)  # [num_sampled, vocab_size]
    elif seeds.num_unseeded == 0:
        q = counter_exponentials(seeds.seeds, seeds.positions, batch.vocab_size)  # [num_sampled, vocab_size]
    else:
        q = torch.empty(shape, device=device)  # [num_sampled, vocab_size]
        unseeded_shape = (seeds.num_unseeded, batch.vocab_size)
        q[seeds.unseeded_ids] = torch.empty(unseeded_shape, device=device).exponential_(generator=generator)
        q[seeds.seeded_ids] = counter_exponentials(seeds.seeds, seeds.positions, batch.vocab_size)
    # A zero draw would turn a filtered token's 0 / 0 into NaN, which argmax picks.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def _gather_logprobs(logits: Tensor, token_ids: Tensor, num_logprobs: list[int | None]) -> DeviceSample:
    """Chosen-token logprobs for every row and the top k (the largest k asked) from the raw logits."""
    logprobs = logits.log_softmax(dim=-1)  # [num_seqs, vocab_size]
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # [num_seqs]
    max_k = max((k or 0) for k in num_logprobs)
    if max_k == 0:
        return DeviceSample(token_ids, chosen, None, None, num_logprobs)
    top_values, top_ids = logprobs.topk(max_k, dim=-1)  # [num_seqs, max_k]
    return DeviceSample(token_ids, chosen, top_values, top_ids, num_logprobs)
