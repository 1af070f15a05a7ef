"""Prometheus metrics for one codec app, in the app's own registry (no global registry), and the
per-request timings that feed them and the access log.

`RequestStats` is filled while a request runs (the handler sets the protocol and token counts, the
generation stream records token arrival); the middleware hands it to `CodecMetrics.observe_request`
once the response is finished. The request's tenant is held here and nowhere else (`identify`: the
auth middleware on HTTP, the servicer from its interceptor's hand-off on gRPC): it labels the
per-tenant prefix-cache counters, fills the audit line, and is what `tenancy.tenant_of` reads.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from services.common import tracing
from services.common.process_metrics import register_process_metrics
from services.common.tenants import DEFAULT_TENANT, Tenant

PRIMED_STATUSES = ("200", "500", "502", "503", "504")  # success and the server errors a codec answers
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
STAGE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)
STATUS_CLIENT_CLOSED = 499  # nginx's convention for "the client went away first"


class StreamOutcome(Enum):
    """How a streamed response ended after its 200 was sent."""

    COMPLETED = "completed"
    FAILED = "failed"
    CLIENT_CLOSED = "client_closed"
    CLIENT_STOPPED_READING = "client_stopped_reading"  # a write waited past limits.stream_send_timeout_ms

    @property
    def is_client_gone(self) -> bool:
        return self in (StreamOutcome.CLIENT_CLOSED, StreamOutcome.CLIENT_STOPPED_READING)


@dataclass
class RequestStats:
    """Timings and token counts of one HTTP request. Holds no prompt or completion text."""

    request_id: str
    started_s: float = field(default_factory=time.perf_counter)
    protocol: str | None = None  # set by generation routes; other routes are not counted
    first_token_s: float | None = None
    last_token_s: float | None = None
    inter_token_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    num_cache_written_tokens: tuple[int, ...] = ()  # per cache breakpoint (Anthropic's creation tokens)
    stream_outcome: StreamOutcome | None = None
    tenant: Tenant | None = None  # set by auth (None: refused before it, or a probe path)
    queue_wait_s: float | None = None  # time spent waiting for admission, when it had to wait
    result_cache: str | None = None  # hit, miss or skip when the request asked for the result cache
    priority_class: str | None = None  # high, normal or low, once a generation route has resolved it

    def identify(self, tenant: Tenant) -> None:
        """Whose request this is: its prefix-cache salt, its prefix-cache counts and its audit line."""
        self.tenant = tenant

    @property
    def tenant_id(self) -> str | None:
        return None if self.tenant is None else self.tenant.tenant_id

    @property
    def key_id(self) -> str | None:
        """The API key's public ID; None in open mode or before auth."""
        return None if self.tenant is None else self.tenant.key_id

    def record_delta(self) -> None:
        """A token delta arrived from the backend now."""
        now = time.perf_counter()
        if self.last_token_s is not None:
            self.inter_token_s.append(now - self.last_token_s)
        if self.first_token_s is None:
            self.first_token_s = now
        self.last_token_s = now

    def set_stream_outcome(self, outcome: StreamOutcome) -> None:
        self.stream_outcome = outcome

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.started_s

    def effective_status(self, http_status: int) -> int:
        """The HTTP status, or what a streamed failure would have been had it happened before the 200."""
        if self.stream_outcome is StreamOutcome.FAILED:
            return 500
        if self.stream_outcome is not None and self.stream_outcome.is_client_gone:
            return STATUS_CLIENT_CLOSED
        return http_status


class ResultCacheMetrics:
    """The exact-result cache's counters (codec/backend/results.py); registered whether it is on or not."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter(
            "kvrelay_codec_result_cache_lookups_total",
            "Exact-result cache lookups by tenant and outcome (hit, miss).",
            ["tenant", "outcome"],
            registry=registry,
        )
        self.bytes = Counter(
            "kvrelay_codec_result_cache_bytes_total",
            "Bytes of results read from (hit) or written to (stored) the exact-result cache, by tenant.",
            ["tenant", "direction"],
            registry=registry,
        )
        self.errors = Counter(
            "kvrelay_codec_result_cache_errors_total",
            "Exact-result cache calls that failed or timed out (get: served as a miss; put: not stored).",
            ["operation"],
            registry=registry,
        )


class CodecMetrics:
    """The codec's instruments. Every app gets its own registry, so tests and apps never share counts."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        register_process_metrics(self.registry)
        self.ttft = Histogram(
            "kvrelay_time_to_first_token_seconds",
            "Time from request arrival to the first generated token.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inter_token = Histogram(
            "kvrelay_inter_token_latency_seconds",
            "Time between consecutive token deltas of one request.",
            buckets=TOKEN_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kvrelay_e2e_request_latency_seconds",
            "Time from request arrival to the end of its response.",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "kvrelay_requests_total",
            "Generation requests by protocol and final status.",
            ["protocol", "status"],
            registry=self.registry,
        )
        self.response_store_errors = Counter(
            "kvrelay_codec_response_store_errors_total",
            "Stored-Responses store failures by operation (put: a finished response was not stored).",
            ["operation"],
            registry=self.registry,
        )
        self.websocket_connections = Gauge(
            "kvrelay_codec_websocket_connections",
            "Open Responses WebSocket connections.",
            registry=self.registry,
        )
        self.websocket_responses = Histogram(
            "kvrelay_codec_websocket_responses_per_connection",
            "Responses made on a Responses WebSocket connection, observed when it closes.",
            buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=self.registry,
        )
        self.compactions = Counter(
            "kvrelay_codec_compactions_total",
            "Conversations compacted by /v1/responses/compact.",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "kvrelay_prompt_tokens_total", "Prompt tokens of admitted requests.", registry=self.registry
        )
        self.generation_tokens = Counter(
            "kvrelay_generation_tokens_total", "Tokens generated for clients.", registry=self.registry
        )
        self.stage = Histogram(
            "kvrelay_codec_stage_seconds",
            "Codec CPU time per stage (template, tokenize, detokenize).",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.prefix_cache_query_tokens = Counter(
            "kvrelay_prefix_cache_query_tokens_total",
            "Prompt tokens of finished generation requests, per tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self.prefix_cache_hit_tokens = Counter(
            "kvrelay_prefix_cache_hit_tokens_total",
            "Prompt tokens served from the prefix cache (usage cached_tokens), per tenant.",
            ["tenant"],
            registry=self.registry,
        )
        self.result_cache = ResultCacheMetrics(self.registry)
        self.auth_failures = Counter(
            "kvrelay_auth_failures_total",
            "Requests refused for a missing or invalid API key.",
            ["reason"],
            registry=self.registry,
        )

    @contextmanager
    def time_stage(self, stage: str, *, traced: bool = True) -> Iterator[None]:
        """Times one run of a codec stage, and traces it as a span named after the stage (when tracing is
        on). `traced=False` for a stage that runs per token and is traced once per request instead."""
        started = time.perf_counter()
        try:
            if traced:
                with tracing.span(stage):
                    yield
            else:
                yield
        finally:
            self.stage.labels(stage=stage).observe(time.perf_counter() - started)

    def prime(self, protocols: Iterable[str]) -> None:
        """Creates each protocol's success and server-error series at zero, so that the first 200 or 5xx
        of a process is an increase Prometheus' rate() sees (a series born at 1 shows none); `kvrelay
        canary` and the KvrelayServerErrors alert read these."""
        for protocol in protocols:
            for status in PRIMED_STATUSES:
                self.requests.labels(protocol=protocol, status=status)

    def observe_request(self, stats: RequestStats, http_status: int) -> None:
        """Record one finished request; requests without a protocol (health, metrics) are skipped."""
        if stats.protocol is None:
            return
        status = stats.effective_status(http_status)
        self.requests.labels(protocol=stats.protocol, status=str(status)).inc()
        self.e2e.observe(time.perf_counter() - stats.started_s)
        ttft = stats.ttft_s
        if ttft is not None:
            self.ttft.observe(ttft)
        for interval in stats.inter_token_s:
            self.inter_token.observe(interval)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_completion_tokens)
        if stats.result_cache != "hit":  # a replay reports its whole prompt cached: no prefix-cache hit
            self.observe_prefix_cache(
                stats.tenant_id or DEFAULT_TENANT, stats.num_prompt_tokens, stats.num_cached_tokens
            )

    def observe_prefix_cache(self, tenant_id: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """One request's prefix-cache use, from its usage. `observe_request` calls it for every finished
        generation request (HTTP and gRPC); call it directly only for work that bypasses that."""
        self.prefix_cache_query_tokens.labels(tenant=tenant_id).inc(num_prompt_tokens)
        self.prefix_cache_hit_tokens.labels(tenant=tenant_id).inc(num_cached_tokens)

    def observe_auth_failure(self, reason: str) -> None:
        """A request refused by auth; `reason` is "missing" or "invalid"."""
        self.auth_failures.labels(reason=reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
