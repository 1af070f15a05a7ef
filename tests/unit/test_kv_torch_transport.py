"""The "torch" KV transport between two real processes over gloo on loopback.

This process plays the decode replica D (TorchReceiver + KVAssembler); a spawned child plays the prefill
replica P (TorchSender). A pipe stands in for the Prefill gRPC stream: D sends the prepared
PrefillRequest, P answers with the KVChunk messages its sender yields, and D can cancel a transfer the
way RemotePrefill cancels its call. Both sides draw the same seeded random KV, so D knows what must
arrive. Every wait is bounded and every child is terminated in a finalizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import re
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from services.engine.kv_export import KV_DTYPES as DTYPES
from services.engine.kv_export import KVExport
from services.kvtransfer import pair_groups
from services.kvtransfer.chunks import KVAssembler, KVTransferFault, Layout, num_chunks
from services.kvtransfer.torch_transport import TorchReceiver, TorchSender
from services.kvtransfer.transport import GrpcReceiver, GrpcSender
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb

STEP_TIMEOUT_S = 15.0  # any single wait in these tests; a hang fails instead of blocking the run


@dataclass(frozen=True)
class Spec:
    """One transfer: the KV P exports (seeded random) and how P should misbehave, if at all."""

    seed: int
    dtype: str = "float32"
    start_token: int = 40
    num_tokens: int = 700
    mode: str = "ok"  # ok | corrupt | short | stall | die

    @property
    def layout(self) -> Layout:
        return Layout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=DTYPES[self.dtype], block_size=16)

    def export(self) -> KVExport:
        layout = self.layout
        shape = (layout.num_layers, self.num_tokens, 2, layout.num_kv_heads, layout.head_dim)
        generator = torch.Generator().manual_seed(self.seed)
        kv = torch.randn(shape, generator=generator).to(layout.dtype)
        return KVExport(self.start_token, kv)

    def header(self) -> kvpb.PrefillHeader:
        return kvpb.PrefillHeader(
            layout=self.layout.to_proto(),
            first_token_position=self.start_token,
            num_kv_tokens=self.num_tokens,
            num_chunks=num_chunks(self.start_token, self.num_tokens, self.layout),
        )


# ------------------------------------------------------------------------------- the child: P


class _FaultySender(TorchSender):
    """Misbehaves on the wire when told to for a tag (its KVChunk messages stay right): "short" sends 64
    bytes less of each chunk, "stall" never sends the last chunk, "die" sends nothing (and the child
    then exits)."""

    def __init__(self) -> None:
        super().__init__(timeout_s=STEP_TIMEOUT_S)
        self.faults: dict[int, str] = {}

    def _send_all(
        self, group: Any, flats: list[torch.Tensor], tag: int, seq: int, deadline: float
    ) -> list[asyncio.Future[None]]:
        fault = self.faults.pop(tag, "")
        if fault == "short":
            flats = [flat[:-64] for flat in flats]
        elif fault == "stall":
            flats = flats[:-1]
        elif fault == "die":
            flats = []
        sent = super()._send_all(group, flats, tag, seq, deadline)
        return sent or [asyncio.get_running_loop().create_future()]  # "die": never settles


def _peer_main(conn: Connection) -> None:
    asyncio.run(_peer(conn))


async def _peer(conn: Connection) -> None:
    sender = _FaultySender()
    tasks: dict[str, asyncio.Task[None]] = {}
    while True:
        try:
            command = await asyncio.to_thread(conn.recv)
        except EOFError:  # the test process went away
            return
        if command[0] == "stop":
            return
        if command[0] == "cancel":  # D gave up on this transfer, as a cancelled Prefill call
            task = tasks.pop(command[1], None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            continue
        request = kvpb.PrefillRequest.FromString(command[1])
        spec: Spec = command[2]
        sender.faults[request.torch_tag] = spec.mode
        tasks[request.request_id] = asyncio.create_task(_serve(conn, sender, request, spec))


async def _serve(conn: Connection, sender: TorchSender, request: kvpb.PrefillRequest, spec: Spec) -> None:
    key = request.request_id
    stream = sender.chunks(request, spec.export(), spec.layout)
    try:
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                if spec.mode == "corrupt" and chunk.index == 1:
                    chunk.crc32 ^= 1
                conn.send(("chunk", key, chunk.SerializeToString()))
                if spec.mode == "die":
                    os._exit(3)  # D got the first chunk message and is waiting for its tensor
        conn.send(("done", key, b""))
    except KVTransferFault as exc:
        conn.send(("error", key, str(exc).encode()))


# ------------------------------------------------------------------------------- this process: D


class PeerGone(Exception):
    pass


class Peer:
    """The child P and the pipe that stands in for its Prefill streams."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.process = ctx.Process(target=_peer_main, args=(child_conn,), daemon=True)
        self.process.start()
        child_conn.close()
        # by request id, not tag: each test's receiver counts tags from 1, and a cancelled transfer's
        # last messages may still be in the pipe when the next test starts
        self._queues: dict[str, asyncio.Queue[tuple[str, bytes]]] = {}

    @contextlib.asynccontextmanager
    async def streams(self) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.conn.fileno(), self._readable)
        try:
            yield
        finally:
            loop.remove_reader(self.conn.fileno())

    def _readable(self) -> None:
        try:
            while self.conn.poll():
                kind, key, payload = self.conn.recv()
                queue = self._queues.get(key)
                if queue is not None:
                    queue.put_nowait((kind, payload))
        except (EOFError, OSError):
            asyncio.get_running_loop().remove_reader(self.conn.fileno())
            for queue in self._queues.values():
                queue.put_nowait(("gone", b""))

    async def transfer(self, receiver: TorchReceiver, spec: Spec) -> tuple[torch.Tensor, list[kvpb.KVChunk]]:
        """D's side of one remote prefill: prepare, ask P, assemble what arrives (or raise)."""
        request = kvpb.PrefillRequest(request_id=uuid.uuid4().hex, transport="torch")
        receiver.prepare(request)
        key = request.request_id
        queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._queues[key] = queue
        self.conn.send(("transfer", request.SerializeToString(), spec))
        assembler = KVAssembler(spec.header(), spec.layout)
        chunks = []
        try:
            while not assembler.is_complete:
                kind, payload = await asyncio.wait_for(queue.get(), STEP_TIMEOUT_S)
                if kind != "chunk":
                    raise PeerGone(f"{kind}: {payload.decode(errors='replace')}")
                chunk = kvpb.KVChunk.FromString(payload)
                assert chunk.data == b""
                chunks.append(chunk)
                assembler.expect(chunk)
                assembler.add(chunk, await receiver.receive(request, chunk, spec.layout))
            kind, _ = await asyncio.wait_for(queue.get(), STEP_TIMEOUT_S)
            assert kind == "done"
        finally:
            del self._queues[key]
            with contextlib.suppress(OSError):
                self.conn.send(("cancel", key))
        return assembler.export().kv, chunks

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("stop",))
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = Peer()
    try:
        yield p
    finally:
        p.stop()


@pytest.fixture
def receiver() -> Iterator[TorchReceiver]:
    r = TorchReceiver(timeout_s=STEP_TIMEOUT_S, host="127.0.0.1")
    try:
        yield r
    finally:
        r.close()


def bits(kv: torch.Tensor) -> torch.Tensor:
    return kv.contiguous().view(torch.uint8)


async def grpc_transfer(spec: Spec) -> tuple[torch.Tensor, list[kvpb.KVChunk]]:
    """The same export through the gRPC transport, in process."""
    request = kvpb.PrefillRequest(transport="grpc")
    receiver = GrpcReceiver()
    receiver.prepare(request)
    assembler = KVAssembler(spec.header(), spec.layout)
    chunks = []
    async for chunk in GrpcSender().chunks(request, spec.export(), spec.layout):
        chunks.append(chunk)
        assembler.expect(chunk)
        assembler.add(chunk, await receiver.receive(request, chunk, spec.layout))
    return assembler.export().kv, chunks


def meta(chunks: list[kvpb.KVChunk]) -> list[tuple[int, int, int, int]]:
    return [(c.index, c.start_token, c.num_tokens, c.crc32) for c in chunks]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_kv_arrives_bit_identical_and_matches_grpc(
    peer: Peer, receiver: TorchReceiver, dtype: str
) -> None:
    spec = Spec(seed=1, dtype=dtype, num_tokens=700 if dtype == "float32" else 1200)
    async with peer.streams():
        kv, chunks = await peer.transfer(receiver, spec)
    assert len(chunks) == spec.header().num_chunks >= 3
    assert torch.equal(bits(kv), bits(spec.export().kv))
    grpc_kv, grpc_chunks = await grpc_transfer(spec)
    assert torch.equal(bits(grpc_kv), bits(kv))
    assert meta(grpc_chunks) == meta(chunks)  # same chunking, positions and checksums


async def test_concurrent_transfers_on_one_pair_stay_apart(
    peer: Peer, receiver: TorchReceiver, caplog: pytest.LogCaptureFixture
) -> None:
    specs = [Spec(seed=10 + i) for i in range(3)]
    caplog.set_level(logging.INFO, logger="services.kvtransfer.pair_groups")
    async with peer.streams():
        await peer.transfer(receiver, Spec(seed=9))  # builds the pair group
        results = await asyncio.gather(*(peer.transfer(receiver, s) for s in specs))
    for spec, (kv, _) in zip(specs, results, strict=True):
        assert torch.equal(bits(kv), bits(spec.export().kv))
    built = [r for r in caplog.records if r.getMessage() == "kv pair group ready"]
    assert len(built) == 1  # this side built one group and reused it for all four transfers


async def test_corrupted_checksum_raises_and_the_pair_recovers(peer: Peer, receiver: TorchReceiver) -> None:
    async with peer.streams():
        await peer.transfer(receiver, Spec(seed=20))
        with pytest.raises(KVTransferFault, match="checksum"):
            await peer.transfer(receiver, Spec(seed=21, mode="corrupt"))
        kv, _ = await peer.transfer(receiver, Spec(seed=22))
    assert torch.equal(bits(kv), bits(Spec(seed=22).export().kv))


async def test_short_message_raises(peer: Peer, receiver: TorchReceiver) -> None:
    async with peer.streams():
        with pytest.raises(KVTransferFault, match="checksum"):
            await peer.transfer(receiver, Spec(seed=30, mode="short"))


@pytest.mark.parametrize("marker_delay_s", [0.0, 1.0], ids=["marker-at-once", "marker-late"])
async def test_missing_tensor_times_out_and_the_pair_recovers(
    peer: Peer, marker_delay_s: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The receiver's own deadline (2 s here, not the 15 s of any other wait) ends the wait for the
    tensor that never comes: gloo reports how long it was given, and that is what was left of 2 s.
    The fault reaches D's caller only once the dead marker is written, however slow the marker is
    ("marker-late" delays it): otherwise P's next transfer would go out on the closed group and fail."""
    if marker_delay_s:
        write = pair_groups._mark_dead

        def late(rendezvous: str, name: str, reason: str) -> None:
            threading.Event().wait(marker_delay_s)  # a slow store client, injected at the seam
            write(rendezvous, name, reason)

        monkeypatch.setattr(pair_groups, "_mark_dead", late)
    receiver = TorchReceiver(timeout_s=STEP_TIMEOUT_S, host="127.0.0.1")
    try:
        async with peer.streams():
            await peer.transfer(receiver, Spec(seed=40))  # builds the pair (slow on a busy machine)
            receiver.timeout_s = 2.0  # the deadline of every transfer prepared from now on
            with pytest.raises(KVTransferFault, match=r"recv of chunk 2 .*Timed out waiting") as caught:
                await peer.transfer(receiver, Spec(seed=41, mode="stall"))
            given_ms = re.search(r"Timed out waiting (\d+)ms", str(caught.value))
            assert given_ms is not None and int(given_ms.group(1)) <= 2000, str(caught.value)
            kv, _ = await peer.transfer(receiver, Spec(seed=42))
        assert torch.equal(bits(kv), bits(Spec(seed=42).export().kv))
    finally:
        receiver.close()


async def test_peer_death_raises_promptly(receiver: TorchReceiver) -> None:
    """The dead peer's closed connection ends the wait, not the receiver's deadline: the fault is the
    connection error, and never a timeout."""
    doomed = Peer()
    try:
        async with doomed.streams():
            await doomed.transfer(receiver, Spec(seed=50))
            # Where gloo notices depends on timing (a chunk's recv, or the pair's), the cause does not.
            with pytest.raises(KVTransferFault, match=r"recv (of chunk \d+|on) .*(closed|reset)") as caught:
                await doomed.transfer(receiver, Spec(seed=51, mode="die"))
            assert "timed out" not in str(caught.value).lower(), str(caught.value)
            assert "deadline" not in str(caught.value), str(caught.value)
    finally:
        doomed.stop()


async def test_sender_refuses_a_tensor_that_does_not_fit_the_layout() -> None:
    spec = Spec(seed=60)
    wide = Layout(num_layers=4, num_kv_heads=2, head_dim=32, dtype=torch.float32, block_size=16)
    request = kvpb.PrefillRequest(rendezvous="127.0.0.1:1", torch_tag=1, transport="torch")
    with pytest.raises(KVTransferFault, match="layout"):
        async for _ in TorchSender().chunks(request, spec.export(), wide):
            pass


def test_prepare_gives_each_transfer_its_own_tag(receiver: TorchReceiver) -> None:
    first, second = kvpb.PrefillRequest(), kvpb.PrefillRequest()
    receiver.prepare(first)
    receiver.prepare(second)
    assert first.rendezvous == second.rendezvous == receiver.rendezvous
    assert first.rendezvous.startswith("127.0.0.1:")
    assert first.torch_tag != second.torch_tag
