"""What the codec needs from the stack behind it: token IDs in, token IDs out. No torch, no text.

`GrpcBackend` (grpc_client.py) implements this over the internal gRPC API; unit tests use fakes at this
seam. Closing a `generate` stream early aborts the request everywhere behind it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.common.engine_input import CacheBreakpoint
from services.common.errors import KvrelayError
from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams


class BackendUnavailableError(KvrelayError):
    """No worker can take the request now (not ready, unreachable): a 503 at the edge."""


class BackendFailedError(KvrelayError):
    """The stack failed after the request was accepted (a mid-stream error event at the edge)."""


class StepTimeoutError(BackendFailedError):
    """The next token took longer than `limits.step_timeout_ms`; the request is aborted."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"no token for {timeout_s * 1000:.0f} ms (limits.step_timeout_ms); aborted")
        self.timeout_s = timeout_s


class BackendRejectedError(KvrelayError):
    """A worker refused the request as invalid (INVALID_ARGUMENT); the codec should have caught it."""


@dataclass(frozen=True)
class GenerationRequest:
    """One request on the codec's way in: built by the admission gate, started by the generator, sent
    to the backend. `stop` (text stop strings) stays in the codec: the backend gets token IDs only."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    timeout_s: float | None = None  # the request's remaining deadline
    session_key: str = ""  # routing affinity only (session.py); "" lets the router choose freely
    # The prefix-cache namespace: always the authenticated tenant's (admission/tenancy.py), never taken
    # from the request body.
    cache_salt: bytes = b""
    priority: int = 0
    # Prefixes the client asked to keep (cache_control, prompt_cache_retention "24h"), in prompt order.
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()
    # An encoder-decoder model's encoder input; `prompt_token_ids` are then the decoder's first tokens.
    encoder_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of sample `index`; `finish_reason` is set on its last delta."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_cache_written_tokens: tuple[int, ...] = ()  # per cache breakpoint, with num_cached_tokens


@dataclass(frozen=True)
class BackendInfo:
    model_name: str
    max_model_len: int
    block_size: int
    model_fingerprint: str
    tokenizer_fingerprint: str
    vocab_size: int
    numerics: str = "default"  # the workers' numerics mode: default or deterministic (engine.deterministic)
    # An encoder-decoder model (T5): the prompt goes to the encoder, the decoder starts at this token.
    encoder_decoder: bool = False
    decoder_start_token_id: int = 0

    @property
    def numerics_fingerprint(self) -> str:
        """What the workers' numbers depend on: the served model fingerprint (weights, KV dtype and, in
        deterministic mode, the kernel build and threads) and the mode."""
        return f"{self.model_fingerprint}/{self.numerics}"


@dataclass(frozen=True)
class ServiceStatus:
    """One service of the stack, as `kvrelay status` lists it."""

    name: str
    role: str
    address: str
    ready: bool
    running: int = 0
    waiting: int = 0
    requests_total: int = 0
    kv_blocks: dict[str, int] = field(default_factory=dict)  # total, active, cached, free
    prefix_cache: dict[str, int] = field(default_factory=dict)  # queries, hits
    # Workers only (None elsewhere): KV bytes sent (prefill) or received (decode), remote prefills, and
    # remote prefills that fell back to a local recompute.
    kv_transfer_bytes_total: int | None = None
    remote_prefills_total: int | None = None
    prefill_fallbacks_total: int | None = None
    # Workers only (None elsewhere): the model.weights served, where small steps end (C kernels) and the
    # resident bytes of the weights, from the worker's info; engine steps by path (kernels, gemm).
    weights: str | None = None
    small_step_max_tokens: int | None = None
    weight_bytes: int | None = None
    numerics: str | None = None  # default or deterministic (engine.deterministic)
    steps_by_path: dict[str, int] | None = None
    # Workers only: the KV tiers below the pool (name, up, hits, misses, bytes, ...: worker.proto KVTier).
    kv_tiers: list[dict[str, Any]] | None = None
    kv_tier_fetched_tokens_total: int | None = None
    # Workers only: what their encoder read (encoder-decoder models; 0 on a decode replica that never
    # recomputes).
    encoded_sequences_total: int | None = None
    encoded_tokens_total: int | None = None


class Backend(Protocol):
    async def info(self) -> BackendInfo:
        """The model behind the stack. Raises BackendUnavailableError when nothing answers."""
        ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Stream token deltas until every sample finishes. Closing the iterator early aborts."""
        ...

    async def statuses(self) -> list[ServiceStatus]:
        """The router and every worker behind it, live."""
        ...

    async def close(self) -> None: ...
