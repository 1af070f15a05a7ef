"""The one configuration schema for every kvrelay process, loaded from YAML plus environment overrides.

Torch-free: the codec and router import this too. `load_config` is the only entry point that
reads files or the environment; everything else takes a `KvrelayConfig` as an argument.

Environment overrides have the shape `KVRELAY_<SECTION>__<KEY>=value` (a double underscore
between nesting levels, names case-insensitive). `KVRELAY_` variables without `__` belong to
other tools (`KVRELAY_URL`, `KVRELAY_TEST_MODEL_DIR`) and are ignored here.
"""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from services.common.errors import ConfigError

ENV_PREFIX = "KVRELAY_"
ENV_SEPARATOR = "__"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    path: str = Field(default="models/smollm2-135m-instruct", min_length=1)
    served_name: str | None = Field(default=None, min_length=1)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # A Jinja chat template file for the codec, replacing the model's own; lets a model without one
    # (a base model such as Gemma 3 270M) serve the chat routes. Relative paths are from the working dir.
    chat_template: str | None = Field(default=None, min_length=1)
    # How the model writes a tool call (services/codec/text/tool_calls.py). auto: Qwen's <tool_call> tokens
    # (hermes), else Llama 3's <|python_tag|> (llama3), else the JSON form of the shipped templates (json).
    tool_call_format: Literal["auto", "json", "hermes", "llama3"] = "auto"
    # Which weights the engine loads (engine/loading/loader.py): safetensors, the prepared directory's
    # float weights in model.dtype; gguf, the GGUF's Q4_1/Q8_0 blocks as stored (model.gguf, kept by
    # `kvrelay models prepare`), run by the CPU kernels with fp32 activations; gguf-int8, the same with
    # the small steps' kernels on int8 activations (large steps unpack each matrix per step); gguf-hybrid,
    # gguf-int8's small steps and, for steps over engine.small_step_max_tokens, a GEMM over a copy of the
    # blocks unpacked once at load (bf16 where the CPU multiplies bf16 in hardware, else fp32); auto:
    # gguf-hybrid wherever the blocks can run (an x86 CPU with AVX2/FMA/F16C, a Llama-family directory
    # that kept its GGUF, dtype and attention auto) and host memory holds both copies, gguf-int8 where it
    # holds only the blocks, else safetensors (loader.choose_weights).
    weights: Literal["auto", "safetensors", "gguf", "gguf-int8", "gguf-hybrid"] = "auto"


class EngineConfig(_Section):
    block_size: int = Field(default=16, ge=1, le=256)
    # Requests waiting for a first step on one worker; past it a new request is refused
    # (RESOURCE_EXHAUSTED) and the router tries another replica (a 503 when every replica is full).
    max_waiting_requests: int = Field(default=256, ge=1)
    kv_cache_memory_mb: int = Field(default=512, gt=0)
    # A step's token budget; unset: 256 on a CPU, 2048 on a GPU (services/engine/loading/device.py).
    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    enable_prefix_caching: bool = True
    num_threads: int | None = Field(default=None, ge=1)
    # Steps of up to this many tokens run every layer in one call into the C kernels; larger ones take
    # torch's GEMMs. Unset: under model.weights gguf-hybrid, the shipped table's entry for this CPU and
    # num_threads (services/engine/ops/step_thresholds.json, `kvrelay bench threshold`); else 64.
    small_step_max_tokens: int | None = Field(default=None, ge=1)
    # Encoder-decoder models: the source tokens one step's newly admitted sequences may bring to the
    # encoder (one sequence always goes, however long). Unset: max_num_batched_tokens' value.
    max_num_encoder_tokens: int | None = Field(default=None, gt=0)
    # Every step on the C kernels, so a token's logits are bitwise the same whatever its neighbours,
    # chunking, cache hits or preemptions (services/engine/loading/deterministic.py; docs/deterministic.md).
    # CPU only; model.weights auto becomes gguf-int8, gguf-hybrid and bfloat16 compute are refused.
    deterministic: bool = False
    max_model_len: int | None = Field(default=None, ge=1)
    seed: int = Field(default=0, ge=0)
    # auto: the first visible CUDA device, else the CPU (services/engine/loading/device.py).
    device: str = Field(default="auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    # On a GPU: this engine's share of the device's total memory (weights, activations, KV together);
    # workers sharing one device may take at most 0.95 between them. Unused on a CPU.
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=0.95)
    # auto: the C kernels on a CPU (ops/kernels.c); on a GPU the Triton kernels (ops/triton) where every
    # layer has a specialization, else torch-native. torch: torch-native everywhere (the oracle and a
    # debugging switch). triton: the Triton kernels, refused at load where a layer has none; on a CPU
    # they run under Triton's interpreter (slow: tests). services/engine/layers/attention_backend.py.
    attention: Literal["auto", "torch", "triton"] = "auto"
    # The KV cache's element type. auto: float16 under model.weights gguf-int8 on the CPU kernels (as
    # llama.cpp keeps its cache: half the bytes a decode step's attention reads, twice the tokens per MB),
    # else the model's own (float32 on the CPU kernels, the compute dtype elsewhere). float16 or float32
    # by name: on torch attention and the CPU kernels only (loader.resolve_kv_dtype). A KV dtype other
    # than the model's own changes the served model fingerprint.
    kv_cache_dtype: Literal["auto", "float32", "float16"] = "auto"
    # Launch step t+1 before reading back step t's tokens, so the host schedules and prepares t+1 while
    # t runs on the device (services/engine/core.py). None: on a GPU only (on a CPU the forward runs on
    # the host itself, so overlapping only delays each token by a step).
    overlap: bool | None = None
    # Capture decode steps as CUDA graphs, one per batch-size bucket (services/engine/cuda_graphs.py).
    # None: on a GPU whose attention can be captured (the Triton kernels). true on a CPU replays the same
    # buckets eagerly (tests); false is the debugging switch.
    cuda_graphs: bool | None = None

    @field_validator("block_size")
    @classmethod
    def _block_size_is_power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise PydanticCustomError("power_of_two", "must be a power of two, got {value}", {"value": value})
        return value


class LimitsConfig(_Section):
    max_input_tokens: int = Field(default=8192, gt=0)
    max_output_tokens: int = Field(default=1024, gt=0)
    default_max_output_tokens: int = Field(default=256, gt=0)
    # None: the device's default (engine/loading/device.py: 32 sequences on a CPU, 256 on a GPU)
    batch_size_limit: int | None = Field(default=None, gt=0)
    step_timeout_ms: int = Field(default=2000, gt=0)
    # Encoder-decoder models: the longest wait for a request's first token (the worker's queue, the
    # encoder pass and the first decoder step); past it the request is aborted (a 504). Their deployments
    # must keep encoder_timeout_ms + step_timeout_ms x max_output_tokens within request_timeout_ms
    # (encoder_timeout_problem), which a worker serving one checks at start.
    encoder_timeout_ms: int = Field(default=30_000, gt=0)
    request_timeout_ms: int = Field(default=2_400_000, gt=0)
    concurrency_limit: int = Field(default=64, gt=0)
    queue_limit: int = Field(default=256, gt=0)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    # A prompt's text (after the chat template) is refused over this many UTF-8 bytes before it is
    # tokenized: 128 bytes per token of the default max_input_tokens.
    max_input_bytes: int = Field(default=1024 * 1024, gt=0)
    # Threads that render templates and tokenize, off the event loop; more requests wait their turn.
    # None: the CPUs this process may use, at most 4.
    prompt_workers: int | None = Field(default=None, gt=0, le=64)
    stream_send_timeout_ms: int = Field(default=30_000, gt=0)


class TenantQuota(_Section):
    """One tenant's limits; a missing limit means the tenant defaults (`quotas.default_*`)."""

    requests_per_minute: int | None = Field(default=None, gt=0)
    tokens_per_minute: int | None = Field(default=None, gt=0)
    max_concurrency: int | None = Field(default=None, gt=0)
    weight: int = Field(default=1, gt=0)  # share of the fair queue
    # The durable queue (queue.*): jobs (background responses) and their tokens waiting or running.
    max_queued_jobs: int | None = Field(default=None, gt=0)
    max_queued_tokens: int | None = Field(default=None, gt=0)


class AuthConfig(_Section):
    """API keys (docs/admission.md). No keys file: open mode, every request is tenant "default"."""

    keys_file: str | None = None  # hashed keys (`kvrelay keys add`); re-read when it changes
    # Prefix-cache salt: from the authenticated tenant, never from the request. Tenants listed in one
    # group share cached prefixes (and can observe each other's cache timing); others never do.
    shared_cache_groups: list[list[str]] = Field(default_factory=list)
    # Open mode (no keys file) is for a laptop: on any address but a loopback one the codec refuses to
    # start in it unless this is true (the chart's auth.allowOpen).
    allow_open: bool = False


class QuotasConfig(_Section):
    """Requests and tokens per minute, per tenant and overall. Unset limits are not enforced."""

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis down: refuse with 503 (false), or admit against a per-process memory store at each limit
    # divided by the codec replicas last seen alive in Redis (true). docs/admission.md.
    fail_open: bool = True
    # The replica count to divide by when no codec has yet been seen alive in Redis (it was down from the
    # start); the chart sets the autoscaler's maximum, the conservative choice.
    fallback_replicas: int = Field(default=1, ge=1)
    global_requests_per_minute: int | None = Field(default=None, gt=0)
    global_tokens_per_minute: int | None = Field(default=None, gt=0)
    default_requests_per_minute: int | None = Field(default=None, gt=0)
    default_tokens_per_minute: int | None = Field(default=None, gt=0)
    default_max_concurrency: int | None = Field(default=None, gt=0)
    # Each tenant's share of the durable queue (docs/async.md); past either, new background work is a 429.
    default_max_queued_jobs: int | None = Field(default=1000, gt=0)
    default_max_queued_tokens: int | None = Field(default=None, gt=0)
    tenants: dict[str, TenantQuota] = Field(default_factory=dict)


class WebSocketConfig(_Section):
    """The Responses API over WebSocket (`/v1/responses`, services/codec/protocols/openai_responses_ws.py)."""

    # `response.create` messages waiting behind the one in flight; past it the turn is refused (429).
    max_queued: int = Field(default=4, ge=0, le=1024)
    # The Open Responses specification limits a connection to 60 minutes.
    max_lifetime_s: float = Field(default=3600.0, gt=0)
    # Well below the idle timeouts of the chart ingress (proxy-read-timeout 3600 s) and of common cloud
    # load balancers (60 s), so an idle socket is never cut by a proxy.
    ping_interval_s: float = Field(default=20.0, gt=0)
    ping_timeout_s: float = Field(default=20.0, gt=0)
    max_frame_bytes: int = Field(default=16 * 1024 * 1024, gt=0)  # larger: closed with 1009


class ResponsesConfig(_Section):
    """Stored Responses (/v1/responses with store: true). No redis_url: one codec's memory."""

    # Its own Redis database (the /N of the URL) so that flushing quotas never touches them; the chart
    # puts them in database 1. rediss:// with ?ssl_ca_certs=... for TLS.
    redis_url: str | None = None
    key_prefix: str = Field(default="kvrelay:responses:", min_length=1, max_length=128)
    ttl_s: int = Field(default=30 * 24 * 3600, gt=0)  # OpenAI keeps stored responses 30 days
    max_per_tenant: int = Field(default=10_000, gt=0)  # the oldest beyond this are dropped
    max_bytes_per_tenant: int = Field(default=256 * 1024 * 1024, gt=0)  # likewise, by stored size
    socket_timeout_ms: int = Field(default=1000, gt=0)  # a silent Redis costs a request at most this
    # /v1/responses/compact seals its summary with AES-256-GCM. The file (the chart mounts it from a
    # Secret) holds lines `<key_id>:<base64 of 32 bytes>`: the first seals, every one opens (rotation).
    # None: one random key per process, so a compacted item opens only on the codec that made it.
    compaction_keys_file: str | None = None
    compaction_max_output_tokens: int = Field(default=512, gt=0)  # the summary the model writes
    websocket: WebSocketConfig = WebSocketConfig()


class QueueConfig(_Section):
    """The async lane's durable queue (docs/async.md): background Responses wait in Redis Streams on a
    Redis of the queue role (noeviction, AOF on), and drainers run them at spare capacity. No url:
    background work is refused (a 400 that says so)."""

    # redis://, rediss:// or redis+sentinel:// (services/common/redis_url.py)
    url: str | None = Field(default=None, min_length=1)
    key_prefix: str = Field(default="kvrelay:queue:", min_length=1, max_length=128)
    socket_timeout_ms: int = Field(default=2000, gt=0)  # a silent Redis costs a request at most this
    # A job whose drainer has not renewed its claim this long (it died) is taken over by another.
    claim_after_ms: int = Field(default=30_000, gt=0)
    max_attempts: int = Field(default=3, gt=0)  # a job taken over this many times fails
    result_ttl_s: int = Field(default=7 * 24 * 3600, gt=0)  # finished jobs' results and events
    # The drainer: at most this many jobs at once, and a new one only while the pools' waiting
    # requests (the router's load reports) are at most drain_max_waiting.
    drain_concurrency: int = Field(default=4, gt=0)
    drain_max_waiting: int = Field(default=0, ge=0)
    drain_poll_ms: int = Field(default=250, gt=0)
    metrics_refresh_ms: int = Field(default=5000, gt=0)  # how often a codec reads the queue's gauges


class BatchesConfig(_Section):
    """The Files and Batches APIs (docs/batches.md): files, batches and their lines in PostgreSQL
    (`store_url`), each line a job of the low class on the async lane's queue. Both `store_url` and
    `queue.url` are needed; without them the routes answer that batches are not configured."""

    store_url: str | None = Field(default=None, min_length=1)  # postgresql://user@host/db (secret: env)
    table_prefix: str = Field(default="kvrelay_", pattern=r"^[a-z_][a-z0-9_]{0,30}$")
    timeout_ms: int = Field(default=5000, gt=0)  # a silent PostgreSQL costs a request at most this
    max_file_bytes: int = Field(default=200 * 1024 * 1024, gt=0)  # an upload's size (OpenAI's batch cap)
    max_files: int = Field(default=1000, gt=0)  # files a tenant may hold, outputs included
    file_ttl_s: int = Field(default=30 * 24 * 3600, gt=0)  # files expire this long after creation
    max_lines: int = Field(default=50_000, gt=0)  # requests in one batch
    # The window a batch must finish in. The APIs accept only 24 hours; a shorter one here (tests)
    # makes every batch expire sooner.
    completion_window_s: int = Field(default=24 * 3600, gt=0)
    sweep_ms: int = Field(default=5000, gt=0)  # how often a drainer ends expired batches


class ResultCacheConfig(_Section):
    """The exact-result cache (docs/result-cache.md): a repeated greedy or seeded request, asked with
    `x-kvrelay-result-cache: use` by a tenant listed here, answered from a stored result. Off without a
    Redis: `url`, else the shared KV tier's (kv_tiers.shared_url)."""

    # redis://, rediss:// or redis+sentinel:// (services/common/redis_url.py)
    url: str | None = Field(default=None, min_length=1)
    tenants: list[str] = Field(default_factory=list)  # the tenants that opted in; "*": every tenant
    ttl_s: int = Field(default=3600, gt=0)
    max_entry_bytes: int = Field(default=1 << 20, gt=0)  # a larger result is not stored
    tenant_capacity_mb: int = Field(default=64, gt=0)  # each tenant's results; past it its oldest go
    timeout_ms: int = Field(default=100, gt=0)  # a lookup slower than this is a miss
    key_prefix: str = Field(default="kvrelay:results:", min_length=1, max_length=128)


class LoggingConfig(_Section):
    """Log levels: `level` for every service, overridden per service (the --log-level flag wins)."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    codec: Literal["debug", "info", "warning", "error"] | None = None
    router: Literal["debug", "info", "warning", "error"] | None = None
    worker: Literal["debug", "info", "warning", "error"] | None = None

    def for_service(self, service: Literal["codec", "router", "worker"]) -> str:
        return getattr(self, service) or self.level


class TlsConfig(_Section):
    """Mutual TLS on internal gRPC and the KV transfer; off unless all three files are set."""

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    # The name clients check the server's certificate for, instead of the address they dial. In Kubernetes
    # the router dials workers at pod IPs that no certificate can name: give every internal certificate
    # one shared name (the chart's internalTls.serverName) and set it here.
    server_name: str | None = Field(default=None, min_length=1, max_length=253)


class DisaggregationConfig(_Section):
    """Prefill/decode split (docs/disaggregation.md)."""

    # always: every eligible request is prefilled remotely; conditional: when the router estimates it is
    # cheaper (services/router/disaggregation.py); never: prefill pools are ignored.
    policy: Literal["always", "conditional", "never"] = "conditional"
    # How KV crosses (docs/disaggregation.md#transports). ipc is used only between a prefill and a decode
    # replica that report one ipc_domain (same GPU, or same host for CPU workers); other pairs get grpc.
    transport: Literal["grpc", "torch", "ipc"] = "grpc"
    transfer_timeout_ms: int = Field(default=30_000, gt=0)  # header plus every KV chunk, else recompute
    min_prompt_tokens: int = Field(default=0, ge=0)  # shorter prompts are prefilled on the decode replica


KV_TIERS_PASSWORD_ENV = "KVRELAY_KV_TIERS_PASSWORD"  # the shared tier's password, never in a file


class KvTiersConfig(_Section):
    """The KV tiers below each worker's pool (docs/kv-tiers.md); off while no `host_capacity_mb`,
    `disk_path` or `shared_url` is set. The shared tier's password comes from the environment
    (KVRELAY_KV_TIERS_PASSWORD), never from this file."""

    disk_path: str | None = Field(default=None, min_length=1)  # a node directory, shared by its workers
    disk_capacity_mb: int = Field(default=10_240, gt=0)
    # redis://, rediss:// or redis+sentinel:// (services/common/redis_url.py), a Redis of its own
    shared_url: str | None = Field(default=None, min_length=1)
    segment_tokens: int = Field(default=256, gt=0)  # a multiple of engine.block_size
    ttl_s: int = Field(default=86_400, gt=0)  # the shared tier's TTL, refreshed by a hit
    timeout_ms: int = Field(default=200, gt=0)  # any one call to the shared tier
    fetch_deadline_ms: int = Field(default=1000, gt=0)  # a request's whole lookup; past it, recompute
    write_mb_per_s: float = Field(default=256.0, gt=0)  # beyond it, writes are dropped (and counted)
    host_capacity_mb: int = Field(default=0, ge=0)  # the worker's memory tier; 0: none
    tenant_capacity_mb: int = Field(default=0, ge=0)  # each tenant's most MiB in the shared tier; 0: no cap
    # Which requests' segments go down to the disk and shared tiers: every one's, or only the prefixes a
    # client asked to keep (cache_control, prompt_cache_retention "24h"); the others stay in the host tier.
    write_through: Literal["always", "requested"] = "always"

    @property
    def is_enabled(self) -> bool:
        return self.disk_path is not None or self.shared_url is not None or self.host_capacity_mb > 0


class RouterConfig(_Section):
    """Replica choice (docs/routing.md)."""

    policy: Literal["cost", "least_loaded", "round_robin"] = "cost"
    prefill_tokens_per_s: float = Field(default=1000.0, gt=0)  # a replica's prompt rate, for estimates
    per_running_seq_ms: float = Field(default=2.0, ge=0)  # what one more stream adds to a decode step
    # Session affinity (docs/routing.md): local (consistent hashing, bounded by this router's own session
    # counts: the tighter balance, for one router), shared (rendezvous hashing over the live replicas, bounded
    # by their reported load: every router replica agrees; the chart's setting), or off.
    affinity: Literal["local", "shared", "off"] = "local"
    affinity_load_factor: float = Field(default=1.25, ge=1.0)  # session affinity yields past this x mean
    # Score candidates by the prompt prefix their cache holds (the prefix index from KV events); off, the
    # cost policy sees no cache (to measure affinity alone).
    prefix_aware: bool = True
    transfer_bytes_per_s: float = Field(default=1e9, gt=0)  # KV transfer rate until measured
    # Count a prompt's segments in the tiers below the pools (the shared tier: every replica's; host and
    # disk: their writer's) as one fetch away, at the fetch rate the workers measured (docs/routing.md).
    tier_aware: bool = True
    tier_bytes_per_s: float = Field(default=1e9, gt=0)  # a tier's fetch rate until a worker measured it


class TracingConfig(_Section):
    """Distributed tracing over OTLP/gRPC (docs/observability.md#tracing); off while no endpoint is set.

    Only `otlp_endpoint` turns tracing on: the standard OTEL_EXPORTER_OTLP_ENDPOINT alone does not (it and
    the other OTEL_EXPORTER_OTLP_* and OTEL_BSP_* variables still tune the exporter once tracing is on)."""

    # http://collector:4317 (plaintext) or https://collector:4317 (TLS); null or "" is off.
    otlp_endpoint: str | None = None
    service_name_prefix: str = Field(default="kvrelay", min_length=1)  # service.name <prefix>-<role>
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)  # share of new traces kept (at the codec)

    @field_validator("otlp_endpoint")
    @classmethod
    def _endpoint_is_a_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip()
        scheme, _, rest = value.partition("://")
        if scheme not in ("http", "https") or not rest.strip("/"):
            raise PydanticCustomError(
                "otlp_endpoint",
                "must be http://HOST:PORT (plaintext) or https://HOST:PORT (TLS), got {value}",
                {"value": value},
            )
        return value


class EntryTlsConfig(_Section):
    """TLS on the codec's API ports, HTTP and public gRPC (services/common/entry_tls.py); off unless both
    files are set. The files are re-read every reload_interval_s: a rotated certificate is served without
    a restart."""

    cert_file: str | None = Field(default=None, min_length=1)
    key_file: str | None = Field(default=None, min_length=1)
    reload_interval_s: float = Field(default=10.0, gt=0)

    @property
    def enabled(self) -> bool:
        return bool(self.cert_file and self.key_file)

    @model_validator(mode="after")
    def _both_or_neither(self) -> EntryTlsConfig:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("server.tls needs both cert_file and key_file, or neither")
        return self


class ServerConfig(_Section):
    host: str = Field(default="127.0.0.1", min_length=1)
    port: int = Field(default=8000, ge=1, le=65535)
    # /metrics on its own port (the chart's codec.metricsPort), off the API port; None: on the API port.
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    # Open HTTP connections at once; past it uvicorn answers 503 at once (no work, no queue).
    max_connections: int = Field(default=1024, gt=0)
    tls: EntryTlsConfig = EntryTlsConfig()  # HTTPS and gRPC over TLS on the API ports


class KvrelayConfig(_Section):
    """The whole system's settings. Cross-section rules are checked here, after each field is valid."""

    model: ModelConfig = ModelConfig()
    engine: EngineConfig = EngineConfig()
    limits: LimitsConfig = LimitsConfig()
    server: ServerConfig = ServerConfig()
    disaggregation: DisaggregationConfig = DisaggregationConfig()
    kv_tiers: KvTiersConfig = KvTiersConfig()
    router: RouterConfig = RouterConfig()
    auth: AuthConfig = AuthConfig()
    quotas: QuotasConfig = QuotasConfig()
    internal_tls: TlsConfig = TlsConfig()
    tracing: TracingConfig = TracingConfig()
    responses: ResponsesConfig = ResponsesConfig()
    result_cache: ResultCacheConfig = ResultCacheConfig()
    queue: QueueConfig = QueueConfig()
    batches: BatchesConfig = BatchesConfig()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _check_cross_field_rules(self) -> KvrelayConfig:
        problems = _cross_field_problems(self)
        if problems:
            raise PydanticCustomError("config_conflict", "{problems}", {"problems": "\n".join(problems)})
        return self


def encoder_timeout_problem(limits: LimitsConfig) -> str | None:
    """The timeout rule of an encoder-decoder deployment, whose first token waits for the encoder: the
    encoder timeout plus every step's timeout must fit the request timeout. None when it holds."""
    worst_case_ms = limits.encoder_timeout_ms + limits.step_timeout_ms * limits.max_output_tokens
    if worst_case_ms <= limits.request_timeout_ms:
        return None
    return (
        f"limits.encoder_timeout_ms ({limits.encoder_timeout_ms}) + limits.step_timeout_ms "
        f"({limits.step_timeout_ms}) × limits.max_output_tokens ({limits.max_output_tokens}) = "
        f"{worst_case_ms} ms exceeds limits.request_timeout_ms ({limits.request_timeout_ms}): an "
        "encoder-decoder request would be cut off by the request timeout while neither its encoder nor a "
        "step had timed out; raise "
        f"limits.request_timeout_ms to at least {worst_case_ms} or lower the others"
    )


def _cross_field_problems(cfg: KvrelayConfig) -> list[str]:
    """Every violated rule that spans settings, each naming the settings by dotted path."""
    limits, engine = cfg.limits, cfg.engine
    problems: list[str] = []
    worst_case_ms = limits.step_timeout_ms * limits.max_output_tokens
    if worst_case_ms > limits.request_timeout_ms:
        problems.append(
            f"limits.step_timeout_ms ({limits.step_timeout_ms}) × limits.max_output_tokens "
            f"({limits.max_output_tokens}) = {worst_case_ms} ms exceeds limits.request_timeout_ms "
            f"({limits.request_timeout_ms}): a request would be cut off by the request timeout while "
            f"no step had timed out; raise limits.request_timeout_ms to at least {worst_case_ms} "
            "or lower the others"
        )
    if limits.default_max_output_tokens > limits.max_output_tokens:
        problems.append(
            f"limits.default_max_output_tokens ({limits.default_max_output_tokens}) exceeds "
            f"limits.max_output_tokens ({limits.max_output_tokens}): a request that leaves its output "
            "length unset would ask for more than the maximum"
        )
    if engine.max_num_batched_tokens is not None and engine.max_num_batched_tokens < engine.block_size:
        problems.append(
            f"engine.max_num_batched_tokens ({engine.max_num_batched_tokens}) is below "
            f"engine.block_size ({engine.block_size}): a step could not fill even one block"
        )
    if cfg.kv_tiers.is_enabled and cfg.kv_tiers.segment_tokens % engine.block_size:
        problems.append(
            f"kv_tiers.segment_tokens ({cfg.kv_tiers.segment_tokens}) is not a multiple of "
            f"engine.block_size ({engine.block_size}): a segment is whole blocks"
        )
    if engine.max_model_len is not None and limits.max_output_tokens >= engine.max_model_len:
        problems.append(
            f"limits.max_output_tokens ({limits.max_output_tokens}) must be below "
            f"engine.max_model_len ({engine.max_model_len}): no room would be left for a prompt"
        )
    return problems


def load_config(
    path: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None
) -> KvrelayConfig:
    """Read `path` (YAML; None means defaults only), apply `KVRELAY_<SECTION>__<KEY>` overrides
    from `env` (default `os.environ`), and validate. Every failure is a `ConfigError`."""
    env = os.environ if env is None else env
    data = _read_yaml_file(Path(path)) if path is not None else {}
    env_sources = _apply_env_overrides(data, env)
    try:
        return KvrelayConfig.model_validate(data)
    except ValidationError as exc:
        origin = f"config file {os.fspath(path)}" if path is not None else "defaults"
        raise ConfigError(_format_validation_error(exc, origin, env_sources)) from None


def dump_config(cfg: KvrelayConfig) -> str:
    """The effective config as YAML, in schema order; `load_config` reads it back unchanged."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def _read_yaml_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections at the top level, not {type(data).__name__}"
        )
    return data


def _apply_env_overrides(data: dict[str, Any], env: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """Write each override into `data` in place; return which variable set which dotted path."""
    sources: dict[tuple[str, ...], str] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or ENV_SEPARATOR not in name:
            continue
        keys = tuple(part.lower() for part in name[len(ENV_PREFIX) :].split(ENV_SEPARATOR))
        annotation = _leaf_annotation(keys, name)
        target = data
        for depth, key in enumerate(keys[:-1]):
            child = target.get(key)
            if child is None:
                child = target[key] = {}
            if not isinstance(child, dict):
                dotted = ".".join(keys[: depth + 1])
                raise ConfigError(
                    f"{name} overrides a key inside {dotted}, but the file sets {dotted} to a value"
                )
            target = child
        target[keys[-1]] = _parse_env_value(env[name], annotation)
        sources[keys] = name
    return sources


def _leaf_annotation(keys: tuple[str, ...], env_name: str) -> Any:
    """The type of the setting at `keys`; a ConfigError naming the variable if there is none."""
    model: type[BaseModel] | None = KvrelayConfig
    annotation: Any = None
    for depth, key in enumerate(keys):
        field = model.model_fields.get(key) if model is not None else None
        if field is None:
            dotted = ".".join(keys[: depth + 1]) or "(empty)"
            raise ConfigError(f"environment variable {env_name} names an unknown setting {dotted}")
        annotation = field.annotation
        is_section = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        model = annotation if is_section else None
    if model is not None:
        raise ConfigError(f"environment variable {env_name} names a whole section; set its keys one by one")
    return annotation


def _parse_env_value(raw: str, annotation: Any) -> Any:
    """A YAML scalar (`512`, `true`, `1.5`, `null`), or a YAML flow list (`[a, b]`) for a list setting;
    settings that take strings keep the raw text."""
    if _accepts_str(annotation):
        return raw
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if isinstance(value, list) and typing.get_origin(annotation) is list:
        return value
    return raw if isinstance(value, dict | list) else value


def _accepts_str(annotation: Any) -> bool:
    if annotation is str:
        return True
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return any(isinstance(arg, str) for arg in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return any(_accepts_str(arg) for arg in typing.get_args(annotation))
    return False


def _format_validation_error(
    exc: ValidationError, origin: str, env_sources: Mapping[tuple[str, ...], str]
) -> str:
    overrides = ", with environment overrides" if env_sources else ""
    lines = [f"invalid configuration ({origin}{overrides}):"]
    for error in exc.errors(include_url=False):
        loc = tuple(str(part) for part in error["loc"])
        source = f" (set by {env_sources[loc]})" if loc in env_sources else ""
        for message in error["msg"].splitlines():
            lines.append(f"  {'.'.join(loc)}: {message}{source}" if loc else f"  {message}")
    return "\n".join(lines)
