"""The KV transfer's wire unit: a block-wise chunk of one request's prompt KV, checksummed.

A chunk is a run of whole blocks (the last one may be partial) covering every layer, K and V:
`[num_layers, num_tokens, 2, num_kv_heads, head_dim]`, sent as the raw little-endian bytes of that
contiguous tensor with a zlib CRC-32. Block-wise rather than layer-wise: a chunk can be written as soon as
it lands, the decode side needs the whole prompt before its first step anyway (its first step reads every
layer), and the chunk count is independent of the model's depth. Chunks are sized near
`TARGET_CHUNK_BYTES` so that one message stays well under gRPC's 4 MiB default and flow control paces them.

The header that precedes the chunks carries a CRC-32 of its own fields (`seal_header`), checked before
anything else of it is read (`check_header_checksum`): the chunk CRCs cannot vouch for the counts and
positions that say where the chunks go. `KVAssembler` on the decode side checks every promise of the
header: chunk order, positions, sizes, checksums, and the total; any mismatch raises `KVTransferFault` and
the decode replica recomputes.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from services.engine.kv_export import KV_DTYPES, KVExport, dtype_name
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb

TARGET_CHUNK_BYTES = 1 << 20


class KVTransferFault(Exception):
    """The KV stream broke a promise (checksum, order, size, layout, fingerprint): fall back."""


@dataclass(frozen=True)
class Layout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    device: str = "cpu"  # the KV cache's device kind: peers must agree on it and on the dtype

    @property
    def bytes_per_token(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * elem

    def to_proto(self) -> kvpb.KVLayout:
        return kvpb.KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=dtype_name(self.dtype),
            block_size=self.block_size,
            device=self.device,
        )

    @classmethod
    def from_proto(cls, msg: kvpb.KVLayout) -> Layout:
        if msg.dtype not in KV_DTYPES:
            raise KVTransferFault(f"unknown KV dtype {msg.dtype!r}")
        device = msg.device or "cpu"
        return cls(
            msg.num_layers, msg.num_kv_heads, msg.head_dim, KV_DTYPES[msg.dtype], msg.block_size, device
        )


def tokens_per_chunk(layout: Layout, target_bytes: int = TARGET_CHUNK_BYTES) -> int:
    """Whole blocks per chunk, as many as fit `target_bytes` (at least one block)."""
    num_blocks = max(1, target_bytes // (layout.bytes_per_token * layout.block_size))
    return num_blocks * layout.block_size


def split(export: KVExport, layout: Layout, target_bytes: int = TARGET_CHUNK_BYTES) -> Iterator[KVExport]:
    """The export in block-aligned pieces (the first piece ends on a block boundary)."""
    step = tokens_per_chunk(layout, target_bytes)
    start, end = export.start_token, export.start_token + export.kv.shape[1]
    position = start
    while position < end:
        boundary = min(end, (position // step + 1) * step)
        yield KVExport(position, export.kv[:, position - start : boundary - start])
        position = boundary


def num_chunks(start_token: int, num_tokens: int, layout: Layout, target: int = TARGET_CHUNK_BYTES) -> int:
    step = tokens_per_chunk(layout, target)
    if num_tokens == 0:
        return 0
    return (start_token + num_tokens - 1) // step - start_token // step + 1


def to_bytes(kv: torch.Tensor) -> bytes:
    """The raw bytes of a tensor in C order: a KV piece [num_layers, num_tokens, 2, kv_heads, head_dim], or
    an encoder output [num_source_tokens, d_model]."""
    return kv.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def checksum(data: bytes | memoryview) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def header_checksum(header: kvpb.PrefillHeader) -> int:
    """The CRC-32 of the header's deterministic serialization with its `crc32` field unset: every field,
    the first token's logprobs and fields this version does not know included."""
    unsealed = kvpb.PrefillHeader()
    unsealed.CopyFrom(header)
    unsealed.ClearField("crc32")
    return checksum(unsealed.SerializeToString(deterministic=True))


def seal_header(header: kvpb.PrefillHeader) -> kvpb.PrefillHeader:
    """Set the header's `crc32`, once every other field is final; returns the header."""
    header.crc32 = header_checksum(header)
    return header


def check_header_checksum(header: kvpb.PrefillHeader) -> None:
    """Raise KVTransferFault for a header whose fields changed after it was sealed (or never sealed)."""
    if header.crc32 != header_checksum(header):
        raise KVTransferFault("header checksum mismatch: the header changed after it was sealed")


def from_bytes(data: bytes, layout: Layout, num_tokens: int) -> torch.Tensor:
    expected = num_tokens * layout.bytes_per_token
    if len(data) != expected:
        raise KVTransferFault(f"chunk holds {len(data)} bytes, its {num_tokens} tokens need {expected}")
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    shape = (layout.num_layers, num_tokens, 2, layout.num_kv_heads, layout.head_dim)
    return flat.view(layout.dtype).view(shape)  # [num_layers, num_tokens, 2, kv_heads, head_dim]


def encoder_states_to_proto(states: torch.Tensor) -> kvpb.EncoderStates:
    """An encoder-decoder request's encoder output [S, d_model], as the message after the header."""
    data = to_bytes(states)
    return kvpb.EncoderStates(data=data, crc32=checksum(data))


def encoder_states_from_proto(
    message: kvpb.EncoderStates, header: kvpb.PrefillHeader, device: torch.device
) -> torch.Tensor:
    """The encoder output the header announced [num_encoder_tokens, encoder_width], on `device`; a
    KVTransferFault for a dtype, size or checksum that does not match (check_header checked the rest)."""
    dtype = KV_DTYPES.get(header.encoder_dtype)
    if dtype is None:
        raise KVTransferFault(f"encoder states in {header.encoder_dtype!r}, not a dtype this replica reads")
    shape = (header.num_encoder_tokens, header.encoder_width)
    expected = shape[0] * shape[1] * dtype.itemsize
    if len(message.data) != expected:
        raise KVTransferFault(
            f"encoder states hold {len(message.data)} bytes; {shape} in {dtype} need {expected}"
        )
    if checksum(message.data) != message.crc32:
        raise KVTransferFault("encoder states checksum mismatch")
    flat = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)
    return flat.view(dtype).view(shape).to(device)


class KVAssembler:
    """Collects a request's chunks into one KV tensor, checking each against the header's promises."""

    def __init__(
        self, header: kvpb.PrefillHeader, expected_layout: Layout, device: torch.device | str = "cpu"
    ) -> None:
        """Collects into a tensor on `device` (the decode replica's KV device: chunks that arrive on it,
        from the torch or ipc transport, never pass through host memory)."""
        layout = Layout.from_proto(header.layout)
        if layout != expected_layout:
            raise KVTransferFault(f"KV layout {layout} differs from this replica's {expected_layout}")
        self.layout = layout
        self.start_token = header.first_token_position
        self.num_tokens = header.num_kv_tokens
        self.num_chunks = header.num_chunks
        shape = (layout.num_layers, self.num_tokens, 2, layout.num_kv_heads, layout.head_dim)
        self.kv = torch.empty(shape, dtype=layout.dtype, device=device)
        self._next_index = 0
        self._next_token = self.start_token
        self.num_bytes = 0

    @property
    def is_complete(self) -> bool:
        return self._next_index == self.num_chunks and self._next_token == self.start_token + self.num_tokens

    def expect(self, chunk: kvpb.KVChunk) -> None:
        """Check a chunk's place in the stream before its bytes are read."""
        if chunk.index != self._next_index or chunk.start_token != self._next_token:
            raise KVTransferFault(
                f"chunk {chunk.index} at token {chunk.start_token}; expected chunk {self._next_index} "
                f"at token {self._next_token}"
            )
        if (
            chunk.index >= self.num_chunks
            or chunk.num_tokens == 0
            or (chunk.start_token + chunk.num_tokens > self.start_token + self.num_tokens)
        ):
            raise KVTransferFault(f"chunk {chunk.index} runs past the {self.num_tokens} promised tokens")

    def add(self, chunk: kvpb.KVChunk, piece: torch.Tensor) -> None:
        """Place a checked chunk's tensor [num_layers, num_tokens, 2, kv_heads, head_dim]."""
        offset = chunk.start_token - self.start_token
        self.kv[:, offset : offset + chunk.num_tokens] = piece
        self._next_index += 1
        self._next_token += chunk.num_tokens
        self.num_bytes += chunk.num_tokens * self.layout.bytes_per_token

    def export(self) -> KVExport:
        if not self.is_complete:
            raise KVTransferFault(
                f"stream ended after {self._next_index} of {self.num_chunks} chunks "
                f"({self._next_token - self.start_token} of {self.num_tokens} tokens)"
            )
        return KVExport(self.start_token, self.kv)
