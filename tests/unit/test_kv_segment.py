"""The KV segment format of the tiers below a worker's pool (services/kvcache/segment.py): a value decodes
only as exactly the segment it was written as; anything else is a SegmentMiss, never wrong bytes."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from services.kvcache.segment import (
    MAGIC,
    NO_TENANT,
    Namespace,
    SegmentMiss,
    decode,
    encode,
    segment_key,
    tenant_tag,
)

NS = Namespace("fp-1", "safetensors", "float32", "float32", 4, num_layers=2, num_kv_heads=1, head_dim=2)
SALT = b"tenant-a-salt"
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
PAYLOAD = bytes(range(256)) * (3 * 4 * NS.bytes_per_token // 256) + bytes(3 * 4 * NS.bytes_per_token % 256)


def stored() -> bytes:
    return encode(NS, SALT, 8, HASHES, PAYLOAD)


def test_a_segment_round_trips() -> None:
    assert NS.bytes_per_token == 2 * 2 * 1 * 2 * 4
    assert decode(stored(), NS, SALT, 8, HASHES) == PAYLOAD


def test_the_key_names_namespace_tenant_and_last_block_never_the_salt() -> None:
    key = segment_key(NS, SALT, HASHES[-1])
    assert key == f"kv1:{NS.tag}:{tenant_tag(SALT)}:{HASHES[-1].hex()}"
    assert SALT.hex() not in key and SALT.decode() not in key
    assert segment_key(NS, b"", HASHES[-1]).split(":")[2] == NO_TENANT
    assert tenant_tag(b"tenant-b-salt") != tenant_tag(SALT)


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "fp-2"},
        {"weights": "gguf-int8"},
        {"compute_dtype": "bfloat16"},
        {"kv_dtype": "float16"},
        {"block_size": 8},
        {"num_layers": 3},
        {"head_dim": 4},
        {"layout": "tokens,layers,kv,heads,head_dim"},
        {"segment_tokens": 512},  # another grid: its keys name other starts
    ],
)
def test_everything_that_changes_kv_bytes_changes_the_namespace(change: dict[str, object]) -> None:
    other = dataclasses.replace(NS, **change)  # type: ignore[arg-type]
    assert other.tag != NS.tag
    with pytest.raises(SegmentMiss):
        decode(stored(), other, SALT, 8, HASHES)


def test_another_tenant_position_or_prefix_is_a_miss() -> None:
    with pytest.raises(SegmentMiss, match="tenant"):
        decode(stored(), NS, b"tenant-b-salt", 8, HASHES)
    with pytest.raises(SegmentMiss, match="first_token"):
        decode(stored(), NS, SALT, 12, HASHES)
    with pytest.raises(SegmentMiss, match="block_hashes"):
        decode(stored(), NS, SALT, 8, [HASHES[0], HASHES[2], HASHES[1]])


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda v: v[: len(v) - 1], "truncated payload"),
        (lambda v: v[:20], "truncated or oversized header"),
        (lambda v: v[:6], "truncated before the header"),
        (lambda v: v[:-1] + bytes([v[-1] ^ 1]), "checksum"),
        (lambda v: b"XXXX" + v[4:], "magic"),
        (lambda v: v + b"\x00", "truncated payload"),
        (lambda v: v[:8] + b"[" + v[9:], "unreadable header"),
    ],
)
def test_a_damaged_value_is_a_miss(damage: object, reason: str) -> None:
    with pytest.raises(SegmentMiss, match=reason):
        decode(damage(stored()), NS, SALT, 8, HASHES)  # type: ignore[operator]


def test_a_header_that_lies_about_its_payload_is_a_miss() -> None:
    value = stored()
    header_len = int.from_bytes(value[4:8], "little")
    header = json.loads(value[8 : 8 + header_len])
    header["num_tokens"] = 8  # two blocks' worth, but three hashes
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    forged = MAGIC + len(encoded).to_bytes(4, "little") + encoded + value[8 + header_len :]
    with pytest.raises(SegmentMiss, match="token count"):
        decode(forged, NS, SALT, 8, HASHES)


def test_only_whole_blocks_with_their_bytes_are_encoded() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        encode(NS, SALT, 6, HASHES, PAYLOAD)
    with pytest.raises(ValueError, match="payload"):
        encode(NS, SALT, 8, HASHES, PAYLOAD[:-1])
