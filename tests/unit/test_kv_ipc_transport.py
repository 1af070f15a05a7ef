"""The ipc KV transport's CPU twin: the same share/open code as on a GPU, over host shared memory, between
real processes; the device checksum against its slow reference; every refusal."""

from __future__ import annotations

import asyncio
import gc
import os
import weakref

import pytest
import torch

from services.engine.kv_export import KVExport
from services.kvtransfer import device_checksum as device_checksum_module
from services.kvtransfer.chunks import KVAssembler, KVTransferFault, Layout
from services.kvtransfer.device_checksum import ROW_WORDS, device_checksum, reference
from services.kvtransfer.ipc_transport import (
    IpcReceiver,
    IpcSender,
    IpcUnavailable,
    ipc_domain,
    kv_checksum,
    open_shared,
    share,
)
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from tests.kv_helpers import prefill_header
from tests.stack_helpers import run_python

CPU = torch.device("cpu")
# 8 KiB per token, 128 KiB per block: a 1 MiB chunk holds 8 blocks (128 tokens)
LAYOUT = Layout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float32, block_size=16)


def flat(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 4096, 4 * ROW_WORDS * 5 + 13])
def test_device_checksum_matches_its_reference(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_checksum_module, "SLICE_ROWS", 2)  # several passes over a small buffer
    data = os.urandom(size)
    assert device_checksum(flat(data)) == reference(data)


def test_device_checksum_sees_a_changed_bit_and_two_words_swapped() -> None:
    data = bytearray(os.urandom(64 * 1024))
    base = device_checksum(flat(bytes(data)))
    flipped = bytearray(data)
    flipped[40_000] ^= 0x10
    assert device_checksum(flat(bytes(flipped))) != base
    swapped = bytearray(data)
    swapped[0:4], swapped[4:8] = data[4:8], data[0:4]
    assert data[0:4] != data[4:8] and device_checksum(flat(bytes(swapped))) != base


CONSUMER = """
import sys, torch
from services.kvtransfer.device_checksum import device_checksum
from services.kvtransfer.ipc_transport import open_shared
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
handle = kvpb.IpcSlice.FromString(sys.stdin.buffer.read())
source = open_shared(handle, int(sys.argv[1]) if len(sys.argv) > 1 else %d, torch.device("cpu"))
copy = source.clone()
print(device_checksum(copy), bytes(copy[:16].tolist()).hex())
"""


def test_a_shared_tensor_opens_in_another_process_with_the_same_bytes() -> None:
    data = torch.randint(0, 256, (300_000,), dtype=torch.uint8)
    window = data[1000:200_000]  # an offset into the storage travels with the handle
    handle = share(window)
    out = run_python(CONSUMER % window.numel(), handle.SerializeToString()).decode().split()
    assert int(out[0]) == device_checksum(window) == reference(bytes(window.tolist()))
    assert out[1] == bytes(window[:16].tolist()).hex()


def test_a_dead_producers_handle_cannot_be_opened() -> None:
    producer = """
import sys, torch
from services.kvtransfer.ipc_transport import share
sys.stdout.buffer.write(share(torch.zeros(4096, dtype=torch.uint8)).SerializeToString())
"""
    handle = kvpb.IpcSlice.FromString(run_python(producer))  # the producer has exited
    assert handle.shm.name
    with pytest.raises(IpcUnavailable, match="cannot open"):
        open_shared(handle, 4096, CPU)


def test_a_handle_that_is_not_torch_shared_memory_is_refused() -> None:
    handle = share(torch.zeros(64, dtype=torch.uint8))
    handle.shm.name = b"/etc_passwd"
    with pytest.raises(IpcUnavailable, match="not a torch shared-memory handle"):
        open_shared(handle, 64, CPU)
    handle = share(torch.zeros(64, dtype=torch.uint8))
    with pytest.raises(IpcUnavailable, match="covers 64 bytes"):
        open_shared(handle, 65, CPU)
    with pytest.raises(IpcUnavailable, match="cannot be opened on cuda"):
        open_shared(handle, 64, torch.device("cuda"))


def test_the_domain_is_stable_and_names_the_device() -> None:
    assert ipc_domain(CPU) == ipc_domain(CPU) and len(ipc_domain(CPU)) == 24


def export_of(num_tokens: int, start: int = 0) -> KVExport:
    shape = (LAYOUT.num_layers, num_tokens, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return KVExport(start, torch.randn(shape))


def header_for(export: KVExport, chunk_bytes: int) -> kvpb.PrefillHeader:
    return prefill_header(export, LAYOUT, chunk_bytes)


async def transfer(
    export: KVExport, request: kvpb.PrefillRequest, tamper: int | None = None
) -> tuple[torch.Tensor, list[kvpb.KVChunk]]:
    """Every chunk from an IpcSender through an IpcReceiver into an assembler; the sender's hold (it keeps
    the export until the caller hangs up) is ended as the decode side ends the call."""
    sender, receiver = IpcSender(CPU, hold_s=60.0), IpcReceiver(CPU)
    receiver.prepare(request)
    header = header_for(export, sender.chunk_bytes(request))
    assembler = KVAssembler(header, LAYOUT)
    chunks = sender.chunks(request, export, LAYOUT)
    seen: list[kvpb.KVChunk] = []
    try:
        while not assembler.is_complete:
            chunk = await anext(chunks)
            if tamper == chunk.index:
                chunk.device_checksum ^= 1
            seen.append(chunk)
            assembler.expect(chunk)
            assembler.add(chunk, await receiver.receive(request, chunk, LAYOUT))
        held = asyncio.ensure_future(anext(chunks))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not held.done(), "the sender must hold the export until the call ends"
        held.cancel()
        with pytest.raises(asyncio.CancelledError):
            await held
    finally:
        await chunks.aclose()
    return assembler.export().kv, seen


def test_an_export_crosses_in_several_chunks_by_handle() -> None:
    export = export_of(300, start=32)
    got, chunks = asyncio.run(transfer(export, kvpb.PrefillRequest(transport="ipc")))
    assert torch.equal(got, export.kv)
    assert len(chunks) == 3 and all(c.HasField("ipc") and not c.data for c in chunks)
    assert {c.ipc.shm.name for c in chunks} == {chunks[0].ipc.shm.name}, "one shared storage per export"


def test_a_decode_replica_in_another_domain_gets_the_bytes() -> None:
    export = export_of(40)
    request = kvpb.PrefillRequest(transport="ipc")
    sender = IpcSender(CPU)
    request.ipc_domain = "another-host"
    assert sender.chunk_bytes(request) == IpcSender(CPU).chunk_bytes(kvpb.PrefillRequest())

    async def collect() -> list[kvpb.KVChunk]:
        return [chunk async for chunk in sender.chunks(request, export, LAYOUT)]

    chunks = asyncio.run(collect())
    assert chunks and all(c.data and not c.HasField("ipc") for c in chunks)
    piece = asyncio.run(IpcReceiver(CPU).receive(request, chunks[0], LAYOUT))
    assert torch.equal(piece, export.kv[:, : chunks[0].num_tokens])


def test_release_lets_go_of_the_mapping_a_transfer_opened() -> None:
    """Held past its transfer, a mapping would keep the peer's memory alive (CUDA IPC ref counts it)."""
    export = export_of(300)
    kv = export.kv.contiguous()
    handle = share(kv.view(torch.uint8).reshape(-1))
    handle.first_token, handle.num_tokens = 0, 300
    request, receiver = kvpb.PrefillRequest(request_id="r"), IpcReceiver(CPU)
    chunk = kvpb.KVChunk(index=0, start_token=0, num_tokens=16, ipc=handle)
    chunk.device_checksum = kv_checksum(kv[:, :16].contiguous().view(torch.uint8).reshape(-1))
    asyncio.run(receiver.receive(request, chunk, LAYOUT))
    mapped = weakref.ref(receiver._opened["r"])
    receiver.release(request)
    gc.collect()
    assert mapped() is None


def test_a_checksum_mismatch_is_a_transfer_fault() -> None:
    with pytest.raises(KVTransferFault, match="device checksum mismatch"):
        asyncio.run(transfer(export_of(300), kvpb.PrefillRequest(transport="ipc"), tamper=1))


def test_a_chunk_outside_the_shared_export_is_refused() -> None:
    export = export_of(20)
    kv = export.kv.contiguous()
    handle = share(kv.view(torch.uint8).reshape(-1))
    handle.first_token, handle.num_tokens = 0, 20
    chunk = kvpb.KVChunk(index=0, start_token=16, num_tokens=8, ipc=handle)
    with pytest.raises(KVTransferFault, match="outside the shared export"):
        asyncio.run(IpcReceiver(CPU).receive(kvpb.PrefillRequest(), chunk, LAYOUT))
