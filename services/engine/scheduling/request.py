"""A request's state inside the engine: token IDs in, token IDs out. No tensors, no I/O."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.block_hash import BlockHasher
from services.common.engine_input import CacheBreakpoint
from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams

if TYPE_CHECKING:
    import torch
    from llguidance import LLMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved; the prompt's KV comes from a prefill replica
    FINISHED = "finished"


# A sequence's key inside the engine: (the caller's request ID, the sample's index among its n).
SeqId = tuple[str, int]

# Stands in `token_ids` for a token sampled by a step still running on the device (overlapped steps,
# core.py): the next step reads its value on the device, and `resolve_token` writes it once known.
PLACEHOLDER = -1


@dataclass
class Request:
    """One sequence: sample `sample_index` of the caller's request `parent_id`. The scheduler gives it
    tokens until `num_computed_tokens` reaches `num_tokens`."""

    parent_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_hasher: BlockHasher
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Samples 1.. of a parallel-sampling group wait until sample 0's prompt is cached, so they share it.
    sample_index: int = 0
    max_model_len: int = 0
    # Prefill replica: after the first token, export the KV of prompt positions from here on and stop.
    export_kv_from: int | None = None
    # Structured output (grammar_matchers.py): the grammar state after the output tokens known so far. Each
    # sampled token is fed to it once, when it is appended or resolved; a recompute feeds it nothing.
    matcher: LLMatcher | None = None
    # The tenant's prefix-cache namespace, also mixed into every block hash (block_hasher).
    cache_salt: bytes = b""
    # Prefixes the client asked to keep below the pool, and for how long (kv_tiers.py SegmentWrites).
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()
    # Encoder-decoder models (issue 51): the encoder's input, the blocks that hold this sequence's
    # cross-attention KV (its own, outside the prefix cache, freed with its self KV), and whether they
    # still wait for the encoder (set at each admission: a preempted sequence re-encodes).
    encoder_token_ids: list[int] = field(default_factory=list)
    cross_block_ids: list[int] = field(default_factory=list)
    needs_encoding: bool = False
    # A prefill replica's encoder-decoder request: its encoder output [S, d_model], kept from the encode
    # to the export, which ships it to the decode replica (which rebuilds the cross KV from it).
    encoder_output: torch.Tensor | None = None
    # When its last encoder pass ran (wall-clock ns), until its next output carries it (the encode span).
    encode_times_ns: tuple[int, int] | None = None

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_committed_blocks: int = 0  # leading blocks registered in the prefix cache
    block_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    has_been_admitted: bool = field(default=False, init=False)  # set once, by `record_admission`
    num_pending_tokens: int = 0  # trailing PLACEHOLDERs in token_ids (sampled, not yet read back)

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.block_hasher.update(self.token_ids)

    @property
    def seq_id(self) -> SeqId:
        return (self.parent_id, self.sample_index)

    @property
    def group_leader_id(self) -> SeqId | None:
        """Sample 0 of the same request, for samples 1..; None for sample 0 itself."""
        return (self.parent_id, 0) if self.sample_index > 0 else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def block_hashes(self) -> list[bytes]:
        return self.block_hasher.hashes

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float]:
        """Lower sorts first: higher priority value means served later (like vLLM)."""
        return (self.priority, self.arrival_time)

    def record_admission(self, num_cached_tokens: int) -> bool:
        """Note the first admission (scheduled, or blocks reserved for remote KV) and how many prompt
        tokens the prefix cache served then. A readmission after a preemption changes nothing and
        returns False."""
        if self.has_been_admitted:
            return False
        self.has_been_admitted = True
        self.num_cached_tokens = num_cached_tokens
        return True

    def append_token(self, token_id: int) -> None:
        """A sampled token is in (the grammar, if any, moves past it)."""
        self.token_ids.append(token_id)
        self.block_hasher.update(self.token_ids)
        if self.matcher is not None:
            self.matcher.consume_token(token_id)

    def append_placeholder(self) -> None:
        """A token was sampled on the device and is not read back yet: hold its place (not hashed)."""
        self.token_ids.append(PLACEHOLDER)
        self.num_pending_tokens += 1

    def resolve_token(self, index: int, token_id: int) -> None:
        """The token at `index` (the oldest placeholder) is known now: write it and hash what is known."""
        self.token_ids[index] = token_id
        self.num_pending_tokens -= 1
        known = self.token_ids if not self.num_pending_tokens else self.token_ids[: -self.num_pending_tokens]
        self.block_hasher.update(known)
        if self.matcher is not None:  # oldest first, so the grammar sees the tokens in order
            self.matcher.consume_token(token_id)

    @property
    def grammar_refused(self) -> bool:
        """True when the grammar refused a token fed to it (never for a token sampled under its mask)."""
        return self.matcher is not None and self.matcher.is_error()

    @property
    def ends_when_resolved(self) -> bool:
        """True when a pending token ends this sequence whatever its value (its length, or a prefill
        replica's one token), so a next step need not compute past it."""
        if not self.num_pending_tokens:
            return False
        return (
            self.export_kv_from is not None
            or self.num_output_tokens >= self.params.max_tokens
            or bool(self.max_model_len and self.num_tokens >= self.max_model_len)
        )

    def check_stop(self, index: int | None = None) -> FinishReason | None:
        """The finish reason once the token at `index` (default: the last) is in, or None to go on.

        With a grammar: a stop token ends the sample as always; then a complete grammar (only EOS may
        follow) is STOP at once, without sampling the EOS; a refused token is LENGTH (the output ended
        before the grammar was complete); max_tokens inside the grammar stays LENGTH. A sequence with a
        grammar is never overlapped (core.py), so its matcher has seen exactly the tokens up to `index`."""
        index = self.num_tokens - 1 if index is None else index
        last = self.token_ids[index]
        num_out = index + 1 - self.num_prompt_tokens
        stops = last in self.params.stop_token_ids or (
            not self.params.ignore_eos and last in self.eos_token_ids
        )
        if stops and num_out >= self.params.min_tokens:
            return FinishReason.STOP
        if self.grammar_refused:
            return FinishReason.LENGTH
        if self.matcher is not None and self.matcher.is_stopped():
            return FinishReason.STOP
        if num_out >= self.params.max_tokens:
            return FinishReason.LENGTH
        if self.max_model_len and index + 1 >= self.max_model_len:
            return FinishReason.LENGTH
        return None
