"""The torch transport's device checksum, the one it uses for KV on a GPU (NCCL), run over gloo on a CPU:
both ends in this process, with spies on every way a chunk's bytes could reach the host for a CRC (zlib,
`Tensor.cpu`, `Tensor.numpy`). A flipped bit in flight still fails the transfer; KV in host memory keeps
the CRC-32 the gRPC transport sends, and a sender from before device checksums is still understood."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from services.engine.kv_export import KVExport
from services.kvtransfer.chunks import KVAssembler, KVTransferFault, Layout
from services.kvtransfer.device_checksum import ChecksumKind
from services.kvtransfer.torch_transport import TorchReceiver, TorchSender, _agreed_checksum, _Announcement
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from tests.kv_helpers import prefill_header

TIMEOUT_S = 15.0
LAYOUT = Layout(num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, block_size=16)
EXPORT = KVExport(40, torch.randn((4, 700, 2, 2, 64), generator=torch.Generator().manual_seed(1)))


class _FlippingSender(TorchSender):
    """Flips one bit of chunk 1's bytes on the wire, after its checksum was taken from the real ones."""

    def _send_all(
        self, group: Any, flats: list[torch.Tensor], tag: int, seq: int, deadline: float
    ) -> list[asyncio.Future[None]]:
        flipped = flats[1].clone()  # [num_bytes] uint8
        flipped[1000] ^= 0x08
        return super()._send_all(group, [flats[0], flipped, *flats[2:]], tag, seq, deadline)


@pytest.fixture
def receiver() -> Iterator[TorchReceiver]:
    r = TorchReceiver(timeout_s=TIMEOUT_S, host="127.0.0.1")
    try:
        yield r
    finally:
        r.close()


async def pull(sender: TorchSender, receiver: TorchReceiver) -> tuple[torch.Tensor, list[kvpb.KVChunk]]:
    """One transfer of EXPORT. P runs as its own task, as a Prefill stream runs apart from D's reads."""
    request = kvpb.PrefillRequest(request_id=uuid.uuid4().hex, transport="torch")
    receiver.prepare(request)
    header = prefill_header(EXPORT, LAYOUT)
    queue: asyncio.Queue[kvpb.KVChunk | None] = asyncio.Queue()

    async def serve() -> None:
        async for chunk in sender.chunks(request, EXPORT, LAYOUT):
            await queue.put(chunk)
        await queue.put(None)

    serving = asyncio.create_task(serve())
    assembler, seen = KVAssembler(header, LAYOUT), []
    try:
        while (chunk := await asyncio.wait_for(queue.get(), TIMEOUT_S)) is not None:
            seen.append(chunk)
            assembler.expect(chunk)
            assembler.add(chunk, await receiver.receive(request, chunk, LAYOUT))
        await serving
    finally:
        serving.cancel()
        with contextlib.suppress(BaseException):
            await serving
    return assembler.export().kv, seen


@pytest.fixture
def host_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every zlib CRC and every `Tensor.cpu` / `Tensor.numpy` call, on any thread, from now on."""
    calls: list[str] = []

    def spy(owner: Any, name: str) -> None:
        real: Callable[..., Any] = getattr(owner, name)

        def recorded(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, recorded)

    spy(zlib, "crc32")
    spy(torch.Tensor, "cpu")
    spy(torch.Tensor, "numpy")
    return calls


def bits(kv: torch.Tensor) -> torch.Tensor:
    return kv.contiguous().view(torch.uint8)


async def test_the_device_checksum_path_reads_no_chunk_on_the_host(
    receiver: TorchReceiver, host_reads: list[str]
) -> None:
    sender = TorchSender(timeout_s=TIMEOUT_S, checksum=ChecksumKind.DEVICE)
    try:
        kv, chunks = await pull(sender, receiver)
    finally:
        sender.close()
    assert host_reads == []  # neither P nor D copied a chunk out to checksum it
    assert len(chunks) >= 3 and all(c.device_checksum and not c.crc32 for c in chunks)
    assert torch.equal(bits(kv), bits(EXPORT.kv))


async def test_a_bit_flipped_in_flight_fails_the_device_checksum(receiver: TorchReceiver) -> None:
    sender = _FlippingSender(timeout_s=TIMEOUT_S, checksum=ChecksumKind.DEVICE)
    try:
        with pytest.raises(KVTransferFault, match="chunk 1: checksum mismatch"):
            await pull(sender, receiver)
    finally:
        sender.close()


async def test_kv_in_host_memory_keeps_the_grpc_crc(receiver: TorchReceiver, host_reads: list[str]) -> None:
    """The spies see the CRC path when it runs (so their silence above means something), and the gloo
    wire is what it was: CRC-32 of each chunk's bytes, no device checksum."""
    sender = TorchSender(timeout_s=TIMEOUT_S)
    try:
        kv, chunks = await pull(sender, receiver)
    finally:
        sender.close()
    assert host_reads.count("crc32") == 2 * len(chunks)  # P's and D's
    offsets = [c.start_token - EXPORT.start_token for c in chunks]
    for chunk, offset in zip(chunks, offsets, strict=True):
        piece = bits(EXPORT.kv[:, offset : offset + chunk.num_tokens]).numpy().tobytes()
        assert (chunk.crc32, chunk.device_checksum) == (zlib.crc32(piece), 0)
    assert torch.equal(bits(kv), bits(EXPORT.kv))


def test_an_announcement_without_a_checksum_means_crc32() -> None:
    old = b'{"group": "g", "backend": "nccl", "seq": 3, "tokens": [16], "replaces": ""}'
    assert _Announcement.decode(old).checksum == ChecksumKind.CRC32
    new = _Announcement("g", "nccl", 3, (16,), checksum=ChecksumKind.DEVICE)
    assert _Announcement.decode(new.encode().encode()) == new
    with pytest.raises(KVTransferFault, match="unreadable"):
        _Announcement.decode(old.replace(b'"replaces"', b'"checksum": "md5", "replaces"'))


def test_p_sends_device_checksums_only_to_a_d_that_lists_them(receiver: TorchReceiver) -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    old_d = kvpb.PrefillRequest(request_id="old", transport="torch")  # a D from before: lists nothing
    assert _agreed_checksum(old_d, cuda) == ChecksumKind.CRC32
    new_d = kvpb.PrefillRequest(request_id="new", transport="torch")
    receiver.prepare(new_d)
    assert list(new_d.kv_checksums) == [ChecksumKind.DEVICE]
    assert _agreed_checksum(new_d, cuda) == ChecksumKind.DEVICE
    assert _agreed_checksum(new_d, cpu) == ChecksumKind.CRC32  # host memory: zlib, as the gRPC wire
