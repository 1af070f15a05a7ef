"""The encoder output a prefill replica ships for an encoder-decoder request (issue 51): the header's
promise is checked against the request before anything is allocated (its source length, this model's
width; none for a decoder-only request), and the states themselves against the header (dtype, size,
CRC-32), each mismatch a KVTransferFault, so the decode replica recomputes."""

from __future__ import annotations

import pytest
import torch

from services.decode.remote_prefill import check_header
from services.kvtransfer.chunks import (
    KVTransferFault,
    Layout,
    encoder_states_from_proto,
    encoder_states_to_proto,
    seal_header,
)
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb

LAYOUT = Layout(num_layers=2, num_kv_heads=3, head_dim=8, dtype=torch.float32, block_size=16)
WIDTH = 32  # the model's d_model
SOURCE = [7, 8, 9, 10, 1]
VOCAB = 259


def request(source: list[int] = SOURCE) -> kvpb.PrefillRequest:
    return kvpb.PrefillRequest(request_id="r", prompt_token_ids=[0], encoder_token_ids=source)


def header(num_encoder: int = len(SOURCE), width: int = WIDTH, dtype: str = "float32") -> kvpb.PrefillHeader:
    made = kvpb.PrefillHeader(
        model_fingerprint="fp",
        layout=LAYOUT.to_proto(),
        first_token=pb.TokenLogprob(token_id=42),
        num_prompt_tokens=1,
        num_kv_tokens=1,
        num_chunks=1,
        num_encoder_tokens=num_encoder,
        encoder_width=width if num_encoder else 0,
        encoder_dtype=dtype if num_encoder else "",
    )
    return seal_header(made)


def test_a_header_that_covers_the_source_at_this_width_passes() -> None:
    check_header(header(), request(), VOCAB, WIDTH)
    check_header(header(num_encoder=0), request(source=[]), VOCAB, encoder_width=0)  # decoder-only


@pytest.mark.parametrize(
    ("made", "source", "width"),
    [
        (header(num_encoder=0), SOURCE, WIDTH),  # no states promised for a source
        (header(num_encoder=len(SOURCE) - 1), SOURCE, WIDTH),  # a source of another length
        (header(width=WIDTH * 2), SOURCE, WIDTH),  # another model's width
        (header(), [], 0),  # states for a decoder-only request
    ],
)
def test_a_header_whose_encoder_states_do_not_fit_is_a_fault(
    made: kvpb.PrefillHeader, source: list[int], width: int
) -> None:
    with pytest.raises(KVTransferFault, match="encoder states"):
        check_header(made, request(source), VOCAB, width)


def test_a_header_that_ends_the_request_promises_nothing() -> None:
    ended = header(num_encoder=0)
    ended.finish_reason = pb.FINISH_REASON_STOP
    check_header(seal_header(ended), request(), VOCAB, WIDTH)


def test_the_states_come_back_as_they_were_sent() -> None:
    states = torch.randn(len(SOURCE), WIDTH)
    message = kvpb.EncoderStates.FromString(encoder_states_to_proto(states).SerializeToString())
    assert torch.equal(encoder_states_from_proto(message, header(), torch.device("cpu")), states)
    halves = encoder_states_to_proto(states.to(torch.bfloat16))
    back = encoder_states_from_proto(halves, header(dtype="bfloat16"), torch.device("cpu"))
    assert torch.equal(back, states.to(torch.bfloat16))


def test_states_that_do_not_match_their_header_are_a_fault() -> None:
    message = encoder_states_to_proto(torch.randn(len(SOURCE), WIDTH))
    with pytest.raises(KVTransferFault, match="not a dtype"):
        encoder_states_from_proto(message, header(dtype="int8"), torch.device("cpu"))
    short = kvpb.EncoderStates(data=message.data[:-4], crc32=message.crc32)
    with pytest.raises(KVTransferFault, match="bytes"):
        encoder_states_from_proto(short, header(), torch.device("cpu"))
    flipped = bytearray(message.data)
    flipped[5] ^= 1
    corrupt = kvpb.EncoderStates(data=bytes(flipped), crc32=message.crc32)
    with pytest.raises(KVTransferFault, match="checksum"):
        encoder_states_from_proto(corrupt, header(), torch.device("cpu"))
