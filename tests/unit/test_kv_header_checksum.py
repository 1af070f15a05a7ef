"""The PrefillHeader's own CRC-32: a sealed header passes, and a change to any field after sealing (the
counts and positions that say where the chunks go, the first token, the layout) is a KVTransferFault."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from services.kvtransfer.chunks import KVTransferFault, Layout, check_header_checksum, seal_header
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb

LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)


def sealed() -> kvpb.PrefillHeader:
    first = pb.TokenLogprob(token_id=42, logprob=-0.25, top=[pb.TopLogprob(token_id=7, logprob=-1.5)])
    header = kvpb.PrefillHeader(
        model_fingerprint="fp",
        layout=LAYOUT.to_proto(),
        first_token=first,
        num_prompt_tokens=40,
        num_cached_tokens=16,
        first_token_position=16,
        num_kv_tokens=24,
        num_chunks=2,
    )
    return seal_header(header)


def test_a_sealed_header_passes_after_a_trip_over_the_wire() -> None:
    check_header_checksum(kvpb.PrefillHeader.FromString(sealed().SerializeToString()))


ALTERATIONS: dict[str, Callable[[kvpb.PrefillHeader], None]] = {
    "num_kv_tokens": lambda h: setattr(h, "num_kv_tokens", 23),
    "first_token_position": lambda h: setattr(h, "first_token_position", 0),
    "num_prompt_tokens": lambda h: setattr(h, "num_prompt_tokens", 41),
    "num_chunks": lambda h: setattr(h, "num_chunks", 3),
    "num_cached_tokens": lambda h: setattr(h, "num_cached_tokens", 0),
    "first_token": lambda h: setattr(h.first_token, "token_id", 43),
    "first_token_logprob": lambda h: setattr(h.first_token, "logprob", -0.5),
    "top_logprob": lambda h: setattr(h.first_token.top[0], "token_id", 8),
    "finish_reason": lambda h: setattr(h, "finish_reason", pb.FINISH_REASON_STOP),
    "layout": lambda h: setattr(h.layout, "num_layers", 3),
    "fingerprint": lambda h: setattr(h, "model_fingerprint", "fq"),
    "num_encoder_tokens": lambda h: setattr(h, "num_encoder_tokens", 5),
    "encoder_width": lambda h: setattr(h, "encoder_width", 64),
}


@pytest.mark.parametrize("field", ALTERATIONS)
def test_a_field_changed_after_sealing_is_a_fault(field: str) -> None:
    header = sealed()
    ALTERATIONS[field](header)
    with pytest.raises(KVTransferFault, match="header checksum mismatch"):
        check_header_checksum(header)


def test_an_unsealed_header_is_a_fault() -> None:
    header = sealed()
    header.ClearField("crc32")
    with pytest.raises(KVTransferFault, match="header checksum mismatch"):
        check_header_checksum(header)
