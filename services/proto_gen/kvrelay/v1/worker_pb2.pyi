from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_MODE_UNSPECIFIED: _ClassVar[PrefillMode]
    PREFILL_MODE_LOCAL: _ClassVar[PrefillMode]
    PREFILL_MODE_REMOTE: _ClassVar[PrefillMode]
    PREFILL_MODE_FALLBACK: _ClassVar[PrefillMode]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
PREFILL_MODE_UNSPECIFIED: PrefillMode
PREFILL_MODE_LOCAL: PrefillMode
PREFILL_MODE_REMOTE: PrefillMode
PREFILL_MODE_FALLBACK: PrefillMode
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "logprobs", "n", "grammar")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    n: int
    grammar: Grammar
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "text", "strict")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    text: str
    strict: bool
    def __init__(self, kind: _Optional[str] = ..., text: _Optional[str] = ..., strict: _Optional[bool] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "session_key", "cache_salt", "priority", "deadline_unix_ms", "remote_prefill", "cache_breakpoints", "encoder_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILL_FIELD_NUMBER: _ClassVar[int]
    CACHE_BREAKPOINTS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    session_key: str
    cache_salt: bytes
    priority: int
    deadline_unix_ms: int
    remote_prefill: RemotePrefill
    cache_breakpoints: _containers.RepeatedCompositeFieldContainer[CacheBreakpoint]
    encoder_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., session_key: _Optional[str] = ..., cache_salt: _Optional[bytes] = ..., priority: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ..., remote_prefill: _Optional[_Union[RemotePrefill, _Mapping]] = ..., cache_breakpoints: _Optional[_Iterable[_Union[CacheBreakpoint, _Mapping]]] = ..., encoder_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class CacheBreakpoint(_message.Message):
    __slots__ = ("num_tokens", "ttl_s")
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    num_tokens: int
    ttl_s: int
    def __init__(self, num_tokens: _Optional[int] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class RemotePrefill(_message.Message):
    __slots__ = ("address", "transport")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    address: str
    transport: str
    def __init__(self, address: _Optional[str] = ..., transport: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "prefill_mode", "kv_transfer_bytes", "kv_transfer_seconds", "kv_link_seconds", "kv_transport", "num_cache_written_tokens")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MODE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_LINK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHE_WRITTEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finish_reason: FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    prefill_mode: PrefillMode
    kv_transfer_bytes: int
    kv_transfer_seconds: float
    kv_link_seconds: float
    kv_transport: str
    num_cache_written_tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., prefill_mode: _Optional[_Union[PrefillMode, str]] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_seconds: _Optional[float] = ..., kv_link_seconds: _Optional[float] = ..., kv_transport: _Optional[str] = ..., num_cache_written_tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_name", "max_model_len", "block_size", "model_fingerprint", "tokenizer_fingerprint", "vocab_size", "role", "dtype", "kv_bytes_per_token", "name", "ipc_domain", "directory_fingerprint", "weights", "small_step_max_tokens", "small_step_source", "weight_bytes", "numerics", "encoder_decoder", "decoder_start_token_id", "encoder_bytes_per_token")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    IPC_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    DIRECTORY_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SMALL_STEP_MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SMALL_STEP_SOURCE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUMERICS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_DECODER_FIELD_NUMBER: _ClassVar[int]
    DECODER_START_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ENCODER_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    max_model_len: int
    block_size: int
    model_fingerprint: str
    tokenizer_fingerprint: str
    vocab_size: int
    role: str
    dtype: str
    kv_bytes_per_token: int
    name: str
    ipc_domain: str
    directory_fingerprint: str
    weights: str
    small_step_max_tokens: int
    small_step_source: str
    weight_bytes: int
    numerics: str
    encoder_decoder: bool
    decoder_start_token_id: int
    encoder_bytes_per_token: int
    def __init__(self, model_name: _Optional[str] = ..., max_model_len: _Optional[int] = ..., block_size: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., role: _Optional[str] = ..., dtype: _Optional[str] = ..., kv_bytes_per_token: _Optional[int] = ..., name: _Optional[str] = ..., ipc_domain: _Optional[str] = ..., directory_fingerprint: _Optional[str] = ..., weights: _Optional[str] = ..., small_step_max_tokens: _Optional[int] = ..., small_step_source: _Optional[str] = ..., weight_bytes: _Optional[int] = ..., numerics: _Optional[str] = ..., encoder_decoder: _Optional[bool] = ..., decoder_start_token_id: _Optional[int] = ..., encoder_bytes_per_token: _Optional[int] = ...) -> None: ...

class KVBlocks(_message.Message):
    __slots__ = ("total", "active", "cached", "free")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    total: int
    active: int
    cached: int
    free: int
    def __init__(self, total: _Optional[int] = ..., active: _Optional[int] = ..., cached: _Optional[int] = ..., free: _Optional[int] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("running", "waiting", "kv_blocks", "prefix_cache_queries", "prefix_cache_hits", "requests_total", "ready", "kv_transfer_bytes_total", "remote_prefills_total", "prefill_fallbacks_total", "requests_aborted_total", "generation_tokens_total", "steps_by_path", "kv_tiers", "kv_tier_fetched_tokens_total", "encoded_sequences_total", "encoded_tokens_total", "waiting_by_priority")
    class StepsByPathEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class WaitingByPriorityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REMOTE_PREFILLS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FALLBACKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_ABORTED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STEPS_BY_PATH_FIELD_NUMBER: _ClassVar[int]
    KV_TIERS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_FETCHED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENCODED_SEQUENCES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    ENCODED_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    WAITING_BY_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_blocks: KVBlocks
    prefix_cache_queries: int
    prefix_cache_hits: int
    requests_total: int
    ready: bool
    kv_transfer_bytes_total: int
    remote_prefills_total: int
    prefill_fallbacks_total: int
    requests_aborted_total: int
    generation_tokens_total: int
    steps_by_path: _containers.ScalarMap[str, int]
    kv_tiers: _containers.RepeatedCompositeFieldContainer[KVTier]
    kv_tier_fetched_tokens_total: int
    encoded_sequences_total: int
    encoded_tokens_total: int
    waiting_by_priority: _containers.ScalarMap[int, int]
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_blocks: _Optional[_Union[KVBlocks, _Mapping]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., requests_total: _Optional[int] = ..., ready: _Optional[bool] = ..., kv_transfer_bytes_total: _Optional[int] = ..., remote_prefills_total: _Optional[int] = ..., prefill_fallbacks_total: _Optional[int] = ..., requests_aborted_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., steps_by_path: _Optional[_Mapping[str, int]] = ..., kv_tiers: _Optional[_Iterable[_Union[KVTier, _Mapping]]] = ..., kv_tier_fetched_tokens_total: _Optional[int] = ..., encoded_sequences_total: _Optional[int] = ..., encoded_tokens_total: _Optional[int] = ..., waiting_by_priority: _Optional[_Mapping[int, int]] = ...) -> None: ...

class KVTier(_message.Message):
    __slots__ = ("name", "up", "hits", "misses", "read_bytes", "written_bytes", "used_bytes", "recompute_instead", "unavailable", "refused", "latency_ms", "bytes_per_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTE_INSTEAD_FIELD_NUMBER: _ClassVar[int]
    UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    up: bool
    hits: int
    misses: int
    read_bytes: int
    written_bytes: int
    used_bytes: int
    recompute_instead: int
    unavailable: int
    refused: int
    latency_ms: float
    bytes_per_s: float
    def __init__(self, name: _Optional[str] = ..., up: _Optional[bool] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., read_bytes: _Optional[int] = ..., written_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., recompute_instead: _Optional[int] = ..., unavailable: _Optional[int] = ..., refused: _Optional[int] = ..., latency_ms: _Optional[float] = ..., bytes_per_s: _Optional[float] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("snapshot", "stored", "removed", "tier_stored", "tier_removed")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TIER_STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_REMOVED_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    tier_stored: _containers.RepeatedCompositeFieldContainer[TierSegment]
    tier_removed: _containers.RepeatedCompositeFieldContainer[TierSegment]
    def __init__(self, snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., tier_stored: _Optional[_Iterable[_Union[TierSegment, _Mapping]]] = ..., tier_removed: _Optional[_Iterable[_Union[TierSegment, _Mapping]]] = ...) -> None: ...

class TierSegment(_message.Message):
    __slots__ = ("tier", "block_hash", "first_block", "num_blocks", "ttl_s")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    tier: str
    block_hash: bytes
    first_block: int
    num_blocks: int
    ttl_s: int
    def __init__(self, tier: _Optional[str] = ..., block_hash: _Optional[bytes] = ..., first_block: _Optional[int] = ..., num_blocks: _Optional[int] = ..., ttl_s: _Optional[int] = ...) -> None: ...

class ReplicasRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Replica(_message.Message):
    __slots__ = ("name", "role", "address", "ready", "load", "info")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    address: str
    ready: bool
    load: LoadResponse
    info: InfoResponse
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., ready: _Optional[bool] = ..., load: _Optional[_Union[LoadResponse, _Mapping]] = ..., info: _Optional[_Union[InfoResponse, _Mapping]] = ...) -> None: ...

class ReplicasResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[Replica]
    def __init__(self, replicas: _Optional[_Iterable[_Union[Replica, _Mapping]]] = ...) -> None: ...
