"""A KV segment as the tiers below a worker's pool store it: one value per key, self-describing, never
pickled. Torch-free: the payload is bytes here; the engine turns tensors into them and back.

A segment holds the KV of `num_tokens` consecutive prompt (or prompt plus output) tokens that start at
`first_token`, every layer, K and V, as the raw little-endian bytes of a contiguous
`[num_layers, num_tokens, 2, num_kv_heads, head_dim]` tensor (the layout of a KV export, `LAYOUT`). Its key
is the hash of its last block: the block hashes chain through every earlier token, the model (the root) and
the tenant's salt (every block), so one hash names the whole prefix that produced these bytes.

The value:

    b"KVS1" ‖ u32 header length ‖ header (canonical JSON, UTF-8) ‖ payload

and the header says everything needed to refuse a value that does not fit: the format version, the
namespace (`Namespace`: everything that changes KV bytes), the tenant tag, the block size, the KV layout
and dtype, the segment's block hashes, where it starts and how many tokens it holds, the payload's length
and its CRC-32. `decode` checks every one against what the reader expects and raises `SegmentMiss` on the
first that differs: a corrupted, truncated, foreign or stale value is a miss that recomputes, never a
wrong token.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

MAGIC = b"KVS1"
FORMAT_VERSION = 1
LAYOUT = "layers,tokens,kv,heads,head_dim"  # [num_layers, num_tokens, 2, num_kv_heads, head_dim]
MAX_HEADER_BYTES = 1 << 16
KEY_PREFIX = "kv1"
NO_TENANT = "-"
_LENGTH = struct.Struct("<I")
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


class SegmentMiss(Exception):
    """A stored value that cannot be used for this request: treated as a miss (and deleted by the tier)."""


@dataclass(frozen=True)
class Namespace:
    """Everything that changes a token's KV bytes. Readers and writers that differ in any of these never
    share a key: a model upgrade, a new weight format or dtype simply stops hitting the old keys, which
    age out."""

    model_fingerprint: str
    weights: str  # model.weights as served: safetensors, gguf, gguf-int8, gguf-hybrid
    compute_dtype: str
    kv_dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layout: str = LAYOUT
    version: int = FORMAT_VERSION
    # The grid segments start on: a key names its start by it (a tail ends inside a segment of this size),
    # so writers with another grid must not share keys with this one.
    segment_tokens: int = 0

    @property
    def tag(self) -> str:
        """16 hex digits of the SHA-256 of the canonical JSON of every field."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest()[:16]

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_SIZES[self.kv_dtype]


def tenant_tag(cache_salt: bytes) -> str:
    """12 hex digits of the SHA-256 of the tenant's salt (never the salt itself), or "-" for no salt. It
    adds no isolation (the block hashes are salted already); it lets a tier count and evict per tenant."""
    return hashlib.sha256(cache_salt).hexdigest()[:12] if cache_salt else NO_TENANT


def segment_key(namespace: Namespace, cache_salt: bytes, last_block_hash: bytes) -> str:
    """`kv1:<namespace>:<tenant tag>:<hash of the segment's last block>`."""
    return f"{KEY_PREFIX}:{namespace.tag}:{tenant_tag(cache_salt)}:{last_block_hash.hex()}"


def tenant_of(key: str) -> str:
    """The tenant tag a segment key carries."""
    return key.split(":")[2]


def last_block_of(key: str) -> bytes:
    """The hash of the segment's last block, which a segment key ends with."""
    return bytes.fromhex(key.rsplit(":", 1)[1])


@dataclass(frozen=True)
class SegmentHeader:
    namespace: str  # Namespace.tag
    tenant: str  # tenant_tag
    block_size: int
    layout: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    first_token: int
    num_tokens: int
    block_hashes: tuple[str, ...]  # hex, one per block of the segment, in order
    payload_len: int
    crc32: int
    version: int = FORMAT_VERSION


def encode(
    namespace: Namespace, cache_salt: bytes, first_token: int, block_hashes: Sequence[bytes], payload: bytes
) -> bytes:
    """The stored value of one segment: the blocks `block_hashes` (full blocks only), starting at token
    `first_token`, whose KV is `payload`."""
    num_tokens = len(block_hashes) * namespace.block_size
    if not block_hashes or first_token % namespace.block_size:
        raise ValueError("a segment is one or more whole blocks, starting on a block boundary")
    if len(payload) != num_tokens * namespace.bytes_per_token:
        raise ValueError(f"payload of {len(payload)} bytes for {num_tokens} tokens")
    header = SegmentHeader(
        namespace=namespace.tag,
        tenant=tenant_tag(cache_salt),
        block_size=namespace.block_size,
        layout=namespace.layout,
        kv_dtype=namespace.kv_dtype,
        num_layers=namespace.num_layers,
        num_kv_heads=namespace.num_kv_heads,
        head_dim=namespace.head_dim,
        first_token=first_token,
        num_tokens=num_tokens,
        block_hashes=tuple(h.hex() for h in block_hashes),
        payload_len=len(payload),
        crc32=zlib.crc32(payload),
    )
    encoded = json.dumps(asdict(header), sort_keys=True, separators=(",", ":")).encode()
    return MAGIC + _LENGTH.pack(len(encoded)) + encoded + payload


def decode(
    value: bytes, namespace: Namespace, cache_salt: bytes, first_token: int, block_hashes: Sequence[bytes]
) -> bytes:
    """The payload of `value` if it is exactly the segment the reader asked for (these blocks, from
    `first_token`, under this namespace and tenant); SegmentMiss naming the first thing that differs."""
    view = memoryview(value)
    if bytes(view[:4]) != MAGIC:
        raise SegmentMiss("not a KV segment (magic)")
    if len(view) < 8:
        raise SegmentMiss("truncated before the header")
    (header_len,) = _LENGTH.unpack(view[4:8])
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(view):
        raise SegmentMiss("truncated or oversized header")
    try:
        fields = json.loads(bytes(view[8 : 8 + header_len]))
        header = SegmentHeader(**{**fields, "block_hashes": tuple(fields["block_hashes"])})
    except (ValueError, TypeError, KeyError) as exc:
        raise SegmentMiss(f"unreadable header: {exc}") from None
    expected = {
        "version": FORMAT_VERSION,
        "namespace": namespace.tag,
        "tenant": tenant_tag(cache_salt),
        "block_size": namespace.block_size,
        "layout": namespace.layout,
        "kv_dtype": namespace.kv_dtype,
        "num_layers": namespace.num_layers,
        "num_kv_heads": namespace.num_kv_heads,
        "head_dim": namespace.head_dim,
        "first_token": first_token,
        "block_hashes": tuple(h.hex() for h in block_hashes),
    }
    for name, want in expected.items():
        if getattr(header, name) != want:
            raise SegmentMiss(f"{name} differs")
    payload = view[8 + header_len :]
    if header.num_tokens != len(block_hashes) * namespace.block_size:
        raise SegmentMiss("token count differs")
    expected_len = header.num_tokens * namespace.bytes_per_token
    if len(payload) != header.payload_len or header.payload_len != expected_len:
        raise SegmentMiss("truncated payload")
    if zlib.crc32(payload) != header.crc32:
        raise SegmentMiss("checksum differs")
    return bytes(payload)
