"""The ipc transport checksums chunks off the event loop: with a slow checksum injected at its seam, a
ticker on the worker's loop keeps ticking through a whole transfer, and the KV still arrives whole and in
order (on a GPU the checksum's read-back waits for the device the same way)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import time
from collections.abc import Iterator

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
SLOW_S = 0.5  # per checksum: each chunk is checksummed by P and again by D
TICK_S = 0.01


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
def pair() -> Iterator[tuple[IpcSender, IpcReceiver]]:
    """A sender and a receiver, built as a worker whose transport is ipc builds them at start (torch's
    shared-memory manager starts then). A full collection over every object pytest and torch hold pauses
    the interpreter for 100 ms or more by itself: they are frozen, so the gaps measured are the
    transport's."""
    built = IpcSender(CPU, hold_s=60.0, expected=True), IpcReceiver(CPU)
    gc.collect()
    gc.freeze()
    try:
        yield built
    finally:
        gc.unfreeze()


async def test_the_loop_keeps_ticking_while_each_chunk_is_checksummed(
    pair: tuple[IpcSender, IpcReceiver], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = ipc_transport.kv_checksum

    def slow(flat: torch.Tensor) -> int:
        time.sleep(SLOW_S)  # a slow device wait, injected at the seam
        return real(flat)

    monkeypatch.setattr(ipc_transport, "kv_checksum", slow)
    ticks: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            await asyncio.sleep(TICK_S)

    shape = (LAYOUT.num_layers, 300, 2, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    export = KVExport(32, torch.randn(shape, generator=torch.Generator().manual_seed(1)))
    started = time.monotonic()
    ticking = asyncio.create_task(ticker())
    try:
        kv, chunks = await pull(*pair, export)
    finally:
        ended = time.monotonic()
        done.set()
        await ticking
    assert [c.index for c in chunks] == [0, 1, 2]
    assert torch.equal(kv, export.kv)
    assert ended - started >= 2 * len(chunks) * SLOW_S  # every slow checksum ran (P's and D's)
    longest = max(b - a for a, b in itertools.pairwise([started, *ticks, ended]))
    assert longest < 0.5 * SLOW_S, f"the loop stalled {longest * 1000:.0f} ms"
