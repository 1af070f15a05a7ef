"""KV chunks: block-aligned splitting, exact byte round trips, and every broken promise is a fault."""

from __future__ import annotations

import pytest
import torch

from services.engine.kv_export import KVExport
from services.kvtransfer.chunks import (
    KVAssembler,
    KVTransferFault,
    Layout,
    checksum,
    from_bytes,
    num_chunks,
    split,
    to_bytes,
    tokens_per_chunk,
)
from services.kvtransfer.transport import GrpcReceiver
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb

LAYOUT = Layout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=4)
SMALL = LAYOUT.bytes_per_token * LAYOUT.block_size * 2  # two blocks per chunk


def export(start: int, num_tokens: int, dtype: torch.dtype = torch.float32) -> KVExport:
    torch.manual_seed(start + num_tokens)
    return KVExport(start, torch.randn(3, num_tokens, 2, 2, 8).to(dtype))


@pytest.mark.parametrize(("start", "num_tokens"), [(0, 1), (0, 8), (0, 19), (4, 13), (8, 8)])
def test_pieces_are_block_aligned_and_cover_the_export_once(start: int, num_tokens: int) -> None:
    pieces = list(split(export(start, num_tokens), LAYOUT, SMALL))
    assert len(pieces) == num_chunks(start, num_tokens, LAYOUT, SMALL)
    assert tokens_per_chunk(LAYOUT, SMALL) == 8
    position = start
    for piece in pieces:
        assert piece.start_token == position
        assert piece is pieces[-1] or (piece.start_token + piece.kv.shape[1]) % 8 == 0
        position += piece.kv.shape[1]
    assert position == start + num_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bytes_round_trip_exactly(dtype: torch.dtype) -> None:
    layout = Layout(3, 2, 8, dtype, 4)
    kv = export(0, 5, dtype).kv
    data = to_bytes(kv)
    assert len(data) == 5 * layout.bytes_per_token
    assert torch.equal(from_bytes(data, layout, 5), kv)
    with pytest.raises(KVTransferFault):
        from_bytes(data[:-1], layout, 5)


def chunks_of(item: KVExport) -> list[kvpb.KVChunk]:
    return [
        kvpb.KVChunk(
            index=i,
            start_token=p.start_token,
            num_tokens=p.kv.shape[1],
            data=to_bytes(p.kv),
            crc32=checksum(to_bytes(p.kv)),
        )
        for i, p in enumerate(split(item, LAYOUT, SMALL))
    ]


def header_for(item: KVExport, **changes: object) -> kvpb.PrefillHeader:
    num_tokens = item.kv.shape[1]
    header = kvpb.PrefillHeader(
        layout=LAYOUT.to_proto(),
        first_token_position=item.start_token,
        num_kv_tokens=num_tokens,
        num_chunks=num_chunks(item.start_token, num_tokens, LAYOUT, SMALL),
    )
    for key, value in changes.items():
        if isinstance(value, kvpb.KVLayout):
            header.layout.CopyFrom(value)
        else:
            setattr(header, key, value)
    return header


def assemble(header: kvpb.PrefillHeader, chunks: list[kvpb.KVChunk]) -> KVExport:
    assembler = KVAssembler(header, LAYOUT)
    for chunk in chunks:
        assembler.expect(chunk)
        assembler.add(chunk, from_bytes(chunk.data, LAYOUT, chunk.num_tokens))
    return assembler.export()


def test_assembler_rebuilds_the_export() -> None:
    item = export(4, 21)
    got = assemble(header_for(item), chunks_of(item))
    assert got.start_token == 4 and torch.equal(got.kv, item.kv)


def test_assembler_refuses_out_of_order_missing_extra_and_overrunning_chunks() -> None:
    item = export(0, 20)
    chunks = chunks_of(item)
    with pytest.raises(KVTransferFault, match="expected chunk 1"):
        assemble(header_for(item), [chunks[0], chunks[2]])
    with pytest.raises(KVTransferFault, match="stream ended"):
        assemble(header_for(item), chunks[:-1])
    with pytest.raises(KVTransferFault, match="runs past"):
        assemble(header_for(item, num_kv_tokens=12, num_chunks=2), chunks)
    with pytest.raises(KVTransferFault):
        assemble(header_for(item, num_chunks=2), chunks)  # a wrong block count in the header


def test_assembler_refuses_another_layout_or_dtype() -> None:
    item = export(0, 8)
    other = Layout(3, 2, 8, torch.bfloat16, 4).to_proto()
    with pytest.raises(KVTransferFault, match="layout"):
        KVAssembler(header_for(item, layout=other), LAYOUT)
    bad = LAYOUT.to_proto()
    bad.dtype = "int3"
    with pytest.raises(KVTransferFault, match="dtype"):
        KVAssembler(header_for(item, layout=bad), LAYOUT)


async def test_the_grpc_receiver_refuses_a_chunk_whose_bytes_changed_on_the_way() -> None:
    """The default transport's bytes come in the stream: one flipped bit is a fault, never installed KV."""
    item = export(0, 8)
    receiver = GrpcReceiver()
    request = kvpb.PrefillRequest()
    (chunk,) = chunks_of(item)
    assert torch.equal(await receiver.receive(request, chunk, LAYOUT), item.kv)
    data = bytearray(chunk.data)
    data[len(data) // 2] ^= 0x01
    chunk.data = bytes(data)
    with pytest.raises(KVTransferFault, match="chunk 0: checksum mismatch"):
        await receiver.receive(request, chunk, LAYOUT)
