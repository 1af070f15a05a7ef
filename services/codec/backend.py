"""What the codec needs from the stack behind it: token IDs in, token IDs out. No torch, no text.

`GrpcBackend` (grpc_backend.py) implements this over the internal gRPC API; unit tests use fakes at this
seam. Closing a `generate` stream early aborts the request everywhere behind it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from services.common.errors import KvrelayError
from services.common.sampling import SamplingParams


class BackendUnavailableError(KvrelayError):
    """No worker can take the request now (not ready, unreachable): a 503 at the edge."""


class BackendFailedError(KvrelayError):
    """The stack failed after the request was accepted (a mid-stream error event at the edge)."""


class BackendRejectedError(KvrelayError):
    """A worker refused the request as invalid (INVALID_ARGUMENT); the codec should have caught it."""


@dataclass(frozen=True)
class GenerateInput:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    session_key: str = ""
    tenant_salt: bytes = b""
    priority: int = 0
    timeout_s: float | None = None  # the request's remaining deadline


@dataclass(frozen=True)
class TokenLogprobOut:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class TokenDelta:
    """New tokens of sample `index`; `finish_reason` is "stop", "length" or "abort" on its last delta."""

    index: int
    token_ids: list[int]
    logprobs: list[TokenLogprobOut]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int


@dataclass(frozen=True)
class BackendInfo:
    model_name: str
    max_context: int
    block_size: int
    model_fingerprint: str
    tokenizer_fingerprint: str
    vocab_size: int


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


class Backend(Protocol):
    async def info(self) -> BackendInfo:
        """The model behind the stack. Raises BackendUnavailableError when nothing answers."""
        ...

    def generate(self, request: GenerateInput) -> AsyncIterator[TokenDelta]:
        """Stream token deltas until every sample finishes. Closing the iterator early aborts."""
        ...

    async def statuses(self) -> list[ServiceStatus]:
        """The router and every worker behind it, live."""
        ...

    async def close(self) -> None: ...
