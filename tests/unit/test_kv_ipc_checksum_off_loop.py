"""The ipc transport checksums chunks off the event loop: every checksum (injected at its seam) runs on
another thread, and while it runs the worker's loop still runs callbacks (the checksum waits for the loop
to answer; one run on the loop itself could never get that answer). The KV still arrives whole and in
order. On a GPU the checksum's read-back waits for the device, which is why it must not block the loop."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import torch

from services.engine.kv_export import KVExport
from services.kvtransfer import ipc_transport
from services.kvtransfer.chunks import KVAssembler, Layout
from services.kvtransfer.ipc_transport import IpcReceiver, IpcSender
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from tests.kv_helpers import prefill_header

CPU = torch.device("cpu")
# 8 KiB per token: a 1 MiB chunk holds 128 tokens, so 300 tokens are 3 chunks
LAYOUT = Layout(num_layers=4, num_kv_heads=4, head_dim=64, dtype=torch.float32, block_size=16)
ANSWER_WAIT_S = 10.0  # how long a checksum waits for the loop's answer; a free loop answers at once


async def pull(
    sender: IpcSender, receiver: IpcReceiver, export: KVExport
) -> tuple[torch.Tensor, list[kvpb.KVChunk]]:
    """Every chunk from the sender through the receiver into an assembler, then hang up."""
    request = kvpb.PrefillRequest(request_id="r", transport="ipc")
    receiver.prepare(request)
    header = prefill_header(export, LAYOUT, sender.chunk_bytes(request))
    assembler = KVAssembler(header, LAYOUT)
    seen = []
    async with contextlib.aclosing(sender.chunks(request, export, LAYOUT)) as chunks:
        while not assembler.is_complete:
            chunk = await anext(chunks)
            seen.append(chunk)
            assembler.expect(chunk)
            assembler.add(chunk, await receiver.receive(request, chunk, LAYOUT))
    receiver.release(request)
    return assembler.export().kv, seen


@pytest.fixture
def pair() -> tuple[IpcSender, IpcReceiver]:
    """A sender and a receiver, built as a worker whose transport is ipc builds them at start (torch's
    shared-memory manager starts then)."""
    return IpcSender(CPU, hold_s=60.0, expected=True), IpcReceiver(CPU)


async def test_each_checksum_runs_off_the_loop_while_the_loop_keeps_running(
    pair: tuple[IpcSender, IpcReceiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ipc_transport.kv_checksum
    loop = asyncio.get_running_loop()
    loop_thread = threading.get_ident()
    calls: list[tuple[bool, bool]] = []  # per checksum: (off the loop's thread, the loop answered)

    def waits_for_the_loop(flat: torch.Tensor) -> int:
        answered = threading.Event()
        loop.call_soon_threadsafe(answered.set)  # only a loop that is free to run callbacks sets it
        calls.append((threading.get_ident() != loop_thread, answered.wait(ANSWER_WAIT_S)))
        return real(flat)

    monkeypatch.setattr(ipc_transport, "kv_checksum", waits_for_the_loop)
    shape = (LAYOUT.num_layers, 300, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    export = KVExport(32, torch.randn(shape, generator=torch.Generator().manual_seed(1)))
    kv, chunks = await pull(*pair, export)
    assert [c.index for c in chunks] == [0, 1, 2]
    assert torch.equal(kv, export.kv)
    assert calls == [(True, True)] * 2 * len(chunks)  # P's and D's checksum of every chunk
