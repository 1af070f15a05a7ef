"""The "ipc" KV transport: the decode replica maps the prefill replica's exported KV and copies it device
to device. For a prefill and a decode process that see the same GPU (two containers of one pod, or
`kvrelay up` on one GPU), where NCCL refuses two ranks on one device; on a CPU the same code runs over
host shared memory (the CPU twin that CI exercises).

    P: export (a fresh tensor on P's device) -> share its storage once -> one KVChunk per chunk with the
       handle, the chunk's place in the export, and a checksum computed on the device
    D: open the handle -> copy the chunk's tokens out -> checksum on D's device -> the assembler

Sharing. `share` turns the export's storage into something another process can open:
`torch.multiprocessing.reductions.reduce_tensor` on CUDA (a cudaIpcMemHandle plus torch's ref counter in
/dev/shm), and torch's file_system sharing on a CPU (a /dev/shm object and the socket of its manager).
`open_shared` rebuilds it on the other side; the handle's fields travel as typed proto fields, never
pickled. A chunk on a GPU is 32 MiB rather than the 1 MiB of the byte transports: only a handle crosses.

Lifetime. P holds the export until D hangs up (D cancels the Prefill call once the KV is installed, or
when it gives up), bounded by the transfer timeout; a cancelled call drops it at once. So D never opens
a freed buffer, whichever device the export is on.

Domains. Two processes can open each other's handles only on one host, in one IPC and PID namespace,
over one /dev/shm, and (CUDA) on one physical GPU: `ipc_domain` hashes those facts. D puts its domain into the
PrefillRequest; a P in another domain sends the bytes in `KVChunk.data` instead (the grpc transport's
chunks), and workers report their domain in Info so the router asks for ipc only between equals. A handle
D still cannot open raises `IpcUnavailable`: D then pulls the KV again over grpc (services/decode).

Integrity. `KVChunk.device_checksum` covers the chunk's bytes in wire order ([num_layers, num_tokens, 2,
kv_heads, head_dim]), computed by P where the KV lives and again by D on the bytes it copied; a mismatch
raises `KVTransferFault` (D recomputes). On a GPU it is device_checksum.py's Fletcher pair (no host copy);
in host memory it is zlib's CRC-32, which runs there several times faster than those int64 passes. Both
sides compute it on a worker thread (`_wire_checksum`), never on the event loop: it reads every byte of
the chunk, and on a GPU its read-back waits for the device, while the loop serves every other request of
the worker. Chunks are still checksummed one at a time, in order, so the messages are the same. Trust:
like the torch transport, this assumes the replicas trust each other (internal token, one pod or node).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import re
import tempfile
from collections.abc import AsyncGenerator

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from services.engine.kv_export import KVExport
from services.kvtransfer.chunks import TARGET_CHUNK_BYTES, KVTransferFault, Layout, split
from services.kvtransfer.device_checksum import kv_checksum
from services.kvtransfer.transport import GrpcReceiver, GrpcSender
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb

log = logging.getLogger(__name__)

# Only a handle crosses per chunk, so GPU chunks are large; on a CPU each chunk's checksum reads its bytes
# in host memory (off the loop, but it holds that transfer up), so its chunks stay at the byte transports'
# size.
IPC_CHUNK_BYTES = {"cuda": 32 << 20, "cpu": TARGET_CHUNK_BYTES}
DEFAULT_HOLD_S = 30.0
_SHM_NAME = re.compile(rb"^/torch_\d+_\d+_\d+$")


class IpcUnavailable(KVTransferFault):
    """This process cannot open the peer's handle (another GPU, namespace or /dev/shm): use grpc."""


def ipc_domain(device: torch.device) -> str:
    """Processes with equal domains can open each other's handles for KV on `device`."""
    # A legacy CUDA IPC handle opens only within one PID namespace, hence the pid namespace too.
    facts = [_read("/proc/sys/kernel/random/boot_id"), _link("/proc/self/ns/ipc"), _link("/proc/self/ns/pid")]
    facts.append(_inode("/dev/shm"))
    if device.type == "cuda":
        facts.append(f"cuda:{torch.cuda.get_device_properties(device).uuid}")
    else:  # torch's shared-memory manager listens on a socket in the temporary directory
        facts.append(f"cpu:{_inode(tempfile.gettempdir())}")
    return hashlib.sha256("\n".join(facts).encode()).hexdigest()[:24]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _link(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _inode(path: str) -> str:
    try:
        stat = os.stat(path)
    except OSError:
        return ""
    return f"{stat.st_dev}:{stat.st_ino}"


# ------------------------------------------------------------------------------ handles


def share(flat: torch.Tensor) -> kvpb.IpcSlice:
    """A handle to a flat uint8 tensor's storage, openable by another process in this domain. On a CPU the
    storage moves into shared memory (one copy); on CUDA it stays where it is."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"expected a flat uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    if flat.device.type == "cuda":
        _, args = reduce_tensor(flat)
        # (cls, size, stride, tensor_offset, storage_cls, dtype, device, handle, size_bytes, offset_bytes,
        #  requires_grad, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required)
        cuda = kvpb.CudaIpcStorage(
            handle=args[7],
            size_bytes=args[8],
            offset_bytes=args[9],
            ref_counter_handle=args[11],
            ref_counter_offset=args[12],
            event_handle=args[13] or b"",
            event_sync_required=bool(args[14]),
        )
        return kvpb.IpcSlice(cuda=cuda, offset_bytes=int(args[3]))
    storage = flat.untyped_storage()
    manager, name, size = storage._share_filename_cpu_()
    shm = kvpb.SharedMemoryStorage(manager=manager, name=name, size_bytes=size)
    return kvpb.IpcSlice(shm=shm, offset_bytes=int(flat.storage_offset()))


def open_shared(handle: kvpb.IpcSlice, num_bytes: int, device: torch.device) -> torch.Tensor:
    """The peer's bytes offset_bytes..+num_bytes as a flat uint8 tensor mapped here (no copy). Raises
    IpcUnavailable when this process cannot open the handle."""
    kind = handle.WhichOneof("storage")
    try:
        if kind == "cuda" and device.type == "cuda":
            return _open_cuda(handle.cuda, handle.offset_bytes, num_bytes, device)
        if kind == "shm" and device.type == "cpu":
            return _open_shm(handle.shm, handle.offset_bytes, num_bytes)
    except IpcUnavailable:
        raise
    except Exception as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        what = f"{type(exc).__name__}: {first_line}"
        raise IpcUnavailable(f"cannot open the peer's {kind} handle: {what}") from exc
    raise IpcUnavailable(f"a {kind or 'missing'} handle cannot be opened on {device}")


def _open_cuda(cuda: kvpb.CudaIpcStorage, offset: int, num_bytes: int, device: torch.device) -> torch.Tensor:
    if offset + num_bytes > cuda.size_bytes:
        raise IpcUnavailable(f"the handle covers {cuda.size_bytes} bytes, not {offset}+{num_bytes}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    # Our own device index, not the peer's: the domain says it is the same GPU, numbered as we see it.
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size([num_bytes]),
        (1,),
        offset,
        torch.TypedStorage,
        torch.uint8,
        index,
        cuda.handle,
        cuda.size_bytes,
        cuda.offset_bytes,
        False,
        cuda.ref_counter_handle,
        cuda.ref_counter_offset,
        cuda.event_handle or None,
        cuda.event_sync_required,
    )


def _open_shm(shm: kvpb.SharedMemoryStorage, offset: int, num_bytes: int) -> torch.Tensor:
    if not _SHM_NAME.match(shm.name) or not shm.manager.endswith(b"/manager.sock"):
        raise IpcUnavailable(f"not a torch shared-memory handle: {shm.name[:64]!r}")
    if offset + num_bytes > shm.size_bytes:
        raise IpcUnavailable(f"the handle covers {shm.size_bytes} bytes, not {offset}+{num_bytes}")
    storage = torch.UntypedStorage._new_shared_filename_cpu(shm.manager, shm.name, shm.size_bytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage, offset, (num_bytes,), (1,))  # [num_bytes]


# ------------------------------------------------------------------------------ the transport


class IpcSender:
    """Prefill side: shares each export once and sends one handle-carrying KVChunk per chunk; sends the
    bytes instead (grpc's chunks) to a decode replica in another domain."""

    def __init__(
        self, device: torch.device, hold_s: float = DEFAULT_HOLD_S, *, expected: bool = False
    ) -> None:
        """`expected`: the stack's transport is ipc, so transfers will come (on a CPU, torch's
        shared-memory manager is started now rather than on the first, mid-request; a worker whose stack
        uses another transport never starts that extra process)."""
        self.domain = ipc_domain(device)
        self.hold_s = hold_s
        self._chunk_bytes = IPC_CHUNK_BYTES[device.type]
        self._bytes = GrpcSender()
        if expected and device.type == "cpu":
            try:
                share(torch.zeros(1, dtype=torch.uint8))
            except RuntimeError as exc:
                log.warning(
                    "shared-memory manager did not start; ipc transfers will fail over",
                    extra={"reason": str(exc)},
                )

    def chunk_bytes(self, request: kvpb.PrefillRequest) -> int:
        return self._chunk_bytes if request.ipc_domain == self.domain else self._bytes.chunk_bytes(request)

    async def chunks(
        self, request: kvpb.PrefillRequest, export: KVExport, layout: Layout
    ) -> AsyncGenerator[kvpb.KVChunk, None]:
        if request.ipc_domain != self.domain:
            async for chunk in self._bytes.chunks(request, export, layout):
                yield chunk
            return
        kv = export.kv.contiguous()  # [num_layers, num_tokens, 2, kv_heads, head_dim]
        handle = share(kv.view(torch.uint8).reshape(-1))
        handle.first_token = export.start_token
        handle.num_tokens = kv.shape[1]
        for index, piece in enumerate(split(KVExport(export.start_token, kv), layout, self._chunk_bytes)):
            yield kvpb.KVChunk(
                index=index,
                start_token=piece.start_token,
                num_tokens=piece.kv.shape[1],
                ipc=handle,
                device_checksum=await _wire_checksum(piece.kv),
            )
        # D copies out of `kv` after these messages: keep it until D hangs up (this is cancelled then).
        await asyncio.sleep(self.hold_s)


class IpcReceiver:
    """Decode side: opens P's handle and copies each chunk's tokens onto this replica's device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.domain = ipc_domain(device)
        self._bytes = GrpcReceiver()
        # The storage a transfer's chunks map, opened once per transfer (a fresh mapping per chunk would
        # fault every page in again): request ID -> the whole export, dropped by `release` when the
        # transfer ends, however it ends (a mapping held would keep the peer's memory alive).
        self._opened: dict[str, torch.Tensor] = {}

    def prepare(self, request: kvpb.PrefillRequest) -> None:
        request.ipc_domain = self.domain

    async def receive(
        self, request: kvpb.PrefillRequest, chunk: kvpb.KVChunk, layout: Layout
    ) -> torch.Tensor:
        if not chunk.HasField("ipc"):  # P is in another domain: the bytes came in the message
            return await self._bytes.receive(request, chunk, layout)
        handle = chunk.ipc
        offset = chunk.start_token - handle.first_token
        if offset < 0 or offset + chunk.num_tokens > handle.num_tokens:
            raise KVTransferFault(
                f"chunk {chunk.index} (tokens {chunk.start_token}+{chunk.num_tokens}) is outside the "
                f"shared export of {handle.num_tokens} tokens from {handle.first_token}"
            )
        whole = self._whole(request.request_id, handle, layout)
        piece = whole[:, offset : offset + chunk.num_tokens].contiguous()  # [L, n, 2, kv_heads, head_dim]
        if await _wire_checksum(piece) != chunk.device_checksum:
            raise KVTransferFault(f"chunk {chunk.index}: device checksum mismatch")
        return piece

    def release(self, request: kvpb.PrefillRequest) -> None:
        self._opened.pop(request.request_id, None)

    def _whole(self, request_id: str, handle: kvpb.IpcSlice, layout: Layout) -> torch.Tensor:
        """The shared export [num_layers, num_tokens, 2, kv_heads, head_dim], opened on first use. A
        transfer shares one export, so its request ID names it."""
        whole = self._opened.get(request_id)
        if whole is None:
            source = open_shared(handle, handle.num_tokens * layout.bytes_per_token, self.device)
            shape = (layout.num_layers, handle.num_tokens, 2, layout.num_kv_heads, layout.head_dim)
            whole = self._opened[request_id] = source.view(layout.dtype).view(shape)
        return whole


async def _wire_checksum(kv: torch.Tensor) -> int:
    """`kv_checksum` of a KV piece's wire bytes, on a worker thread (see Integrity). On a GPU the thread
    runs on this thread's current stream, so it reads the piece after the work queued for it here, exactly
    as it would on the loop."""
    stream = torch.cuda.current_stream(kv.device) if kv.device.type == "cuda" else None
    return await asyncio.to_thread(_checksum_on, stream, kv)


def _checksum_on(stream: torch.cuda.Stream | None, kv: torch.Tensor) -> int:
    # Host memory has no stream to follow (and torch.cuda.stream(None) would start CUDA).
    with contextlib.nullcontext() if stream is None else torch.cuda.stream(stream):
        return kv_checksum(_wire_bytes(kv))


def _wire_bytes(kv: torch.Tensor) -> torch.Tensor:
    """A KV piece's bytes in wire order, flat uint8, on its device."""
    return kv.contiguous().view(torch.uint8).reshape(-1)
