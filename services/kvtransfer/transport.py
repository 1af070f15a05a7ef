"""How the chunk bytes travel. The Prefill stream always carries the header and one KVChunk per chunk;
a transport decides where each chunk's tensor goes.

- `GrpcSender` / `GrpcReceiver`: the bytes ride in `KVChunk.data` (the default; works anywhere).
- `services/kvtransfer/torch_transport.py`: the tensors go over a torch.distributed pair group (gloo
  between CPU processes, NCCL between GPUs); `KVChunk` then carries only positions, token count and
  checksum.
- `services/kvtransfer/ipc_transport.py`: the decode replica maps the prefill replica's exported KV (CUDA
  IPC on one GPU, shared memory on one host) and copies it device to device; `KVChunk` carries a handle.

The decode side calls `KVReceiver.prepare` on its PrefillRequest before the call (the torch transport
fills in `rendezvous` and `torch_tag` there), and both sides get that request with every transfer.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

import torch

from services.engine.kv_export import KVExport
from services.kvtransfer.chunks import (
    TARGET_CHUNK_BYTES,
    KVTransferFault,
    Layout,
    checksum,
    from_bytes,
    split,
    to_bytes,
)
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb


class KVSender(Protocol):
    """Prefill side: turns one export into its KVChunk messages (and ships tensors out of band). The
    request is the caller's, with the fields its receiver's `prepare` filled in (rendezvous, tag)."""

    def chunk_bytes(self, request: kvpb.PrefillRequest) -> int:
        """The chunk size `chunks` splits this request's export by (the header's chunk count follows it)."""
        ...

    def chunks(
        self, request: kvpb.PrefillRequest, export: KVExport, layout: Layout
    ) -> AsyncGenerator[kvpb.KVChunk, None]: ...


class KVReceiver(Protocol):
    """Decode side. `prepare` fills the request's transport fields before the Prefill call (it may raise
    KVTransferFault: the caller then recomputes); `receive` gives the tensor
    [num_layers, num_tokens, 2, kv_heads, head_dim] of one chunk of that request, checked; `release`
    drops whatever the receiver still holds for that request's transfer, once it has ended in any way."""

    def prepare(self, request: kvpb.PrefillRequest) -> None: ...

    async def receive(
        self, request: kvpb.PrefillRequest, chunk: kvpb.KVChunk, layout: Layout
    ) -> torch.Tensor: ...

    def release(self, request: kvpb.PrefillRequest) -> None: ...


class GrpcSender:
    def chunk_bytes(self, request: kvpb.PrefillRequest) -> int:
        return TARGET_CHUNK_BYTES

    async def chunks(
        self, request: kvpb.PrefillRequest, export: KVExport, layout: Layout
    ) -> AsyncGenerator[kvpb.KVChunk, None]:
        for index, piece in enumerate(split(export, layout)):
            data = to_bytes(piece.kv)
            yield kvpb.KVChunk(
                index=index,
                start_token=piece.start_token,
                num_tokens=piece.kv.shape[1],
                data=data,
                crc32=checksum(data),
            )


class GrpcReceiver:
    def prepare(self, request: kvpb.PrefillRequest) -> None:
        """Nothing to set up: the bytes come in the stream itself."""

    async def receive(
        self, request: kvpb.PrefillRequest, chunk: kvpb.KVChunk, layout: Layout
    ) -> torch.Tensor:
        if checksum(chunk.data) != chunk.crc32:
            raise KVTransferFault(f"chunk {chunk.index}: checksum mismatch")
        return from_bytes(chunk.data, layout, chunk.num_tokens)

    def release(self, request: kvpb.PrefillRequest) -> None:
        """Nothing is held between chunks."""
