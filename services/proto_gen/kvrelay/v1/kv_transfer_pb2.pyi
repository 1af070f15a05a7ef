from kvrelay.v1 import worker_pb2 as _worker_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "cache_salt", "priority", "num_skip_tokens", "model_fingerprint", "kv_dtype", "transport", "rendezvous", "torch_tag", "kv_device", "ipc_domain", "kv_checksums", "cache_breakpoints", "encoder_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    TORCH_TAG_FIELD_NUMBER: _ClassVar[int]
    KV_DEVICE_FIELD_NUMBER: _ClassVar[int]
    IPC_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_BREAKPOINTS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _worker_pb2.SamplingParams
    cache_salt: bytes
    priority: int
    num_skip_tokens: int
    model_fingerprint: str
    kv_dtype: str
    transport: str
    rendezvous: str
    torch_tag: int
    kv_device: str
    ipc_domain: str
    kv_checksums: _containers.RepeatedScalarFieldContainer[str]
    cache_breakpoints: _containers.RepeatedCompositeFieldContainer[_worker_pb2.CacheBreakpoint]
    encoder_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_worker_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[bytes] = ..., priority: _Optional[int] = ..., num_skip_tokens: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., transport: _Optional[str] = ..., rendezvous: _Optional[str] = ..., torch_tag: _Optional[int] = ..., kv_device: _Optional[str] = ..., ipc_domain: _Optional[str] = ..., kv_checksums: _Optional[_Iterable[str]] = ..., cache_breakpoints: _Optional[_Iterable[_Union[_worker_pb2.CacheBreakpoint, _Mapping]]] = ..., encoder_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "block_size", "device")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    device: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class PrefillHeader(_message.Message):
    __slots__ = ("model_fingerprint", "layout", "first_token", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "first_token_position", "num_kv_tokens", "num_chunks", "crc32", "num_encoder_tokens", "encoder_width", "encoder_dtype")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    NUM_ENCODER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_WIDTH_FIELD_NUMBER: _ClassVar[int]
    ENCODER_DTYPE_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    layout: KVLayout
    first_token: _worker_pb2.TokenLogprob
    finish_reason: _worker_pb2.FinishReason
    num_prompt_tokens: int
    num_cached_tokens: int
    first_token_position: int
    num_kv_tokens: int
    num_chunks: int
    crc32: int
    num_encoder_tokens: int
    encoder_width: int
    encoder_dtype: str
    def __init__(self, model_fingerprint: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., first_token: _Optional[_Union[_worker_pb2.TokenLogprob, _Mapping]] = ..., finish_reason: _Optional[_Union[_worker_pb2.FinishReason, str]] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., first_token_position: _Optional[int] = ..., num_kv_tokens: _Optional[int] = ..., num_chunks: _Optional[int] = ..., crc32: _Optional[int] = ..., num_encoder_tokens: _Optional[int] = ..., encoder_width: _Optional[int] = ..., encoder_dtype: _Optional[str] = ...) -> None: ...

class EncoderStates(_message.Message):
    __slots__ = ("data", "crc32")
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    crc32: int
    def __init__(self, data: _Optional[bytes] = ..., crc32: _Optional[int] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("index", "start_token", "num_tokens", "data", "crc32", "ipc", "device_checksum")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    START_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    IPC_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    index: int
    start_token: int
    num_tokens: int
    data: bytes
    crc32: int
    ipc: IpcSlice
    device_checksum: int
    def __init__(self, index: _Optional[int] = ..., start_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., ipc: _Optional[_Union[IpcSlice, _Mapping]] = ..., device_checksum: _Optional[int] = ...) -> None: ...

class IpcSlice(_message.Message):
    __slots__ = ("cuda", "shm", "offset_bytes", "first_token", "num_tokens")
    CUDA_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    cuda: CudaIpcStorage
    shm: SharedMemoryStorage
    offset_bytes: int
    first_token: int
    num_tokens: int
    def __init__(self, cuda: _Optional[_Union[CudaIpcStorage, _Mapping]] = ..., shm: _Optional[_Union[SharedMemoryStorage, _Mapping]] = ..., offset_bytes: _Optional[int] = ..., first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class CudaIpcStorage(_message.Message):
    __slots__ = ("handle", "size_bytes", "offset_bytes", "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    REF_COUNTER_OFFSET_FIELD_NUMBER: _ClassVar[int]
    EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    EVENT_SYNC_REQUIRED_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    size_bytes: int
    offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool
    def __init__(self, handle: _Optional[bytes] = ..., size_bytes: _Optional[int] = ..., offset_bytes: _Optional[int] = ..., ref_counter_handle: _Optional[bytes] = ..., ref_counter_offset: _Optional[int] = ..., event_handle: _Optional[bytes] = ..., event_sync_required: _Optional[bool] = ...) -> None: ...

class SharedMemoryStorage(_message.Message):
    __slots__ = ("manager", "name", "size_bytes")
    MANAGER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    manager: bytes
    name: bytes
    size_bytes: int
    def __init__(self, manager: _Optional[bytes] = ..., name: _Optional[bytes] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("header", "chunk", "encoder_states")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ENCODER_STATES_FIELD_NUMBER: _ClassVar[int]
    header: PrefillHeader
    chunk: KVChunk
    encoder_states: EncoderStates
    def __init__(self, header: _Optional[_Union[PrefillHeader, _Mapping]] = ..., chunk: _Optional[_Union[KVChunk, _Mapping]] = ..., encoder_states: _Optional[_Union[EncoderStates, _Mapping]] = ...) -> None: ...
