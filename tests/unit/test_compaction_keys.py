"""protocols/compaction_keys.py: compaction items open only where, and for whom, they were sealed.

Round trip; any tampering (ciphertext, nonce, key id), another tenant or model, a retired key: rejected
as CompactionRejectedError and nothing else, whatever the input; rotation through a two-key file; key
files that do not parse refused with a ConfigError naming the line and never the key.
"""

from __future__ import annotations

import base64
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from services.codec.protocols import compaction_keys
from services.codec.protocols.compaction_keys import (
    MAX_BLOB_CHARS,
    CompactionKeys,
    CompactionRejectedError,
)
from services.common.errors import ConfigError, InvalidRequestError

PAYLOAD: dict[str, Any] = {
    "summary": "The user asked about tides; we settled on the Moon. ünïcode ✓",
    "items": [{"role": "user", "content": "hi"}],
    "n": 3,
}
TENANT = "acme"
MODEL = "llama-3-8b"


def key_line(key_id: str, key: bytes | None = None) -> str:
    return f"{key_id}:{base64.b64encode(key or os.urandom(32)).decode()}"


def write(tmp_path: Path, *lines: str, name: str = "keys") -> str:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture
def ring(tmp_path: Path) -> CompactionKeys:
    return CompactionKeys.from_file(write(tmp_path, "# the compaction keys", "", key_line("k1")))


def rejected(ring: CompactionKeys, blob: Any, *, tenant: str = TENANT, model: str = MODEL) -> str:
    """The reason `blob` is refused (and that it is refused as nothing but CompactionRejectedError)."""
    with pytest.raises(CompactionRejectedError) as info:
        ring.open(blob, tenant=tenant, model=model, param="input[0].encrypted_content")
    err = info.value
    assert isinstance(err, InvalidRequestError)
    assert err.param == "input[0].encrypted_content"
    assert "cannot be opened by this server for this tenant and model" in str(err)
    assert TENANT not in str(err) and MODEL not in str(err)
    return err.reason


def split(blob: str) -> tuple[str, str, bytes]:
    version, key_id, body = blob.split(".")
    return version, key_id, base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))


def join(version: str, key_id: str, raw: bytes) -> str:
    return f"{version}.{key_id}.{base64.urlsafe_b64encode(raw).rstrip(b'=').decode()}"


def flip(raw: bytes, index: int) -> bytes:
    return raw[:index] + bytes([raw[index] ^ 0x01]) + raw[index + 1 :]


def test_round_trip(ring: CompactionKeys) -> None:
    blob = ring.seal(PAYLOAD, tenant=TENANT, model=MODEL)
    assert ring.open(blob, tenant=TENANT, model=MODEL) == PAYLOAD
    version, key_id, raw = split(blob)
    assert (version, key_id) == ("kvc1", "k1")
    assert all(c.isalnum() or c in "-_." for c in blob)  # URL-safe
    assert b"tides" not in raw and "tides" not in blob  # not readable
    # A fresh nonce per seal: the same payload never seals to the same blob.
    assert ring.seal(PAYLOAD, tenant=TENANT, model=MODEL) != blob


def test_tampering_is_rejected(ring: CompactionKeys) -> None:
    blob = ring.seal(PAYLOAD, tenant=TENANT, model=MODEL)
    version, key_id, raw = split(blob)
    assert rejected(ring, join(version, key_id, flip(raw, 20))) == "authentication"  # ciphertext
    assert rejected(ring, join(version, key_id, flip(raw, len(raw) - 1))) == "authentication"  # tag
    assert rejected(ring, join(version, key_id, flip(raw, 0))) == "authentication"  # nonce
    assert rejected(ring, join(version, key_id, raw[:-1])) == "authentication"  # truncated
    assert rejected(ring, join(version, "k2", raw)) == "unknown_key"
    assert rejected(ring, join("kvc2", key_id, raw)) == "malformed"


def test_key_id_is_authenticated(tmp_path: Path) -> None:
    """The same key under two ids: renaming the id in the blob still fails (it is associated data)."""
    key = os.urandom(32)
    ring = CompactionKeys.from_file(write(tmp_path, key_line("a", key), key_line("b", key)))
    version, _, raw = split(ring.seal(PAYLOAD, tenant=TENANT, model=MODEL))
    assert rejected(ring, join(version, "b", raw)) == "authentication"


def test_bound_to_tenant_and_model(ring: CompactionKeys) -> None:
    blob = ring.seal(PAYLOAD, tenant=TENANT, model=MODEL)
    assert rejected(ring, blob, tenant="other") == "authentication"
    assert rejected(ring, blob, model="other-model") == "authentication"
    # The associated data cannot be shifted between tenant and model.
    shifted = ring.seal(PAYLOAD, tenant="a", model="b.c")
    assert rejected(ring, shifted, tenant="a.b", model="c") == "authentication"
    assert ring.open(shifted, tenant="a", model="b.c") == PAYLOAD


def test_rotation(tmp_path: Path) -> None:
    old, new = key_line("old"), key_line("new")
    before = CompactionKeys.from_file(write(tmp_path, old, name="before"))
    during = CompactionKeys.from_file(write(tmp_path, new, old, name="during"))
    after = CompactionKeys.from_file(write(tmp_path, new, name="after"))
    assert during.sealing_key_id == "new" and during.key_ids == ("new", "old")

    old_blob = before.seal(PAYLOAD, tenant=TENANT, model=MODEL)
    assert during.open(old_blob, tenant=TENANT, model=MODEL) == PAYLOAD
    assert rejected(after, old_blob) == "unknown_key"

    new_blob = during.seal(PAYLOAD, tenant=TENANT, model=MODEL)
    assert split(new_blob)[1] == "new"
    assert after.open(new_blob, tenant=TENANT, model=MODEL) == PAYLOAD
    assert rejected(before, new_blob) == "unknown_key"


def test_other_key_same_id_is_rejected(tmp_path: Path) -> None:
    one = CompactionKeys.from_file(write(tmp_path, key_line("k1"), name="one"))
    two = CompactionKeys.from_file(write(tmp_path, key_line("k1"), name="two"))
    assert rejected(two, one.seal(PAYLOAD, tenant=TENANT, model=MODEL)) == "authentication"


SECRET = base64.b64encode(b"S" * 32).decode()  # recognisable key material that must never be echoed


@pytest.mark.parametrize(
    ("lines", "line_number", "fragment"),
    [
        ([SECRET], 1, "expected <key_id>:<base64"),
        (["# c", "", f"bad id!:{SECRET}"], 3, "key id"),
        ([f"{'x' * 33}:{SECRET}"], 1, "key id"),
        ([f":{SECRET}"], 1, "key id"),
        ([f"k1:{SECRET[:-4]}!!!!"], 1, "not valid base64"),
        ([f"k1:{SECRET[:-1]}"], 1, "not valid base64"),
        ([f"k1:{base64.b64encode(b'S' * 16).decode()}"], 1, "16 bytes, not 32"),
        ([f"k1:{SECRET}", f"k1:{SECRET}"], 2, "appears twice"),
        ([f"k1:{SECRET} é"], 1, "not valid base64"),
    ],
)
def test_bad_key_files(tmp_path: Path, lines: list[str], line_number: int, fragment: str) -> None:
    path = write(tmp_path, *lines)
    with pytest.raises(ConfigError) as info:
        CompactionKeys.from_file(path)
    message = str(info.value)
    assert f"line {line_number}" in message and fragment in message and path in message
    assert SECRET[:12] not in message and "SSSS" not in message


def test_empty_and_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="holds no key"):
        CompactionKeys.from_file(write(tmp_path, "# nothing yet", ""))
    with pytest.raises(ConfigError, match="cannot be read"):
        CompactionKeys.from_file(str(tmp_path / "absent"))
    (tmp_path / "binary").write_bytes(b"\xff\xfe" + SECRET.encode())
    with pytest.raises(ConfigError, match="cannot be read") as info:
        CompactionKeys.from_file(str(tmp_path / "binary"))
    assert SECRET[:12] not in str(info.value)


def test_whitespace_and_comments(tmp_path: Path) -> None:
    key = os.urandom(32)
    path = write(tmp_path, "  # a comment", "", f"  k1 : {base64.b64encode(key).decode()}  ", "\t")
    ring = CompactionKeys.from_file(path)
    assert ring.key_ids == ("k1",)


def test_ephemeral(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compaction_keys, "_ephemeral_warned", False)
    with caplog.at_level(logging.WARNING, logger=compaction_keys.__name__):
        ring = CompactionKeys.from_file(None)
        other = CompactionKeys.from_file(None)
    warnings = [r for r in caplog.records if "compaction_keys_file is not set" in r.getMessage()]
    assert len(warnings) == 1  # once per process
    blob = ring.seal(PAYLOAD, tenant=TENANT, model=MODEL)
    assert ring.open(blob, tenant=TENANT, model=MODEL) == PAYLOAD
    # Another process (another ephemeral ring) does not hold the key.
    assert rejected(other, blob) == "unknown_key"


@pytest.mark.parametrize(
    "blob",
    [
        "",
        "garbage",
        "kvc1",
        "kvc1..",
        "kvc1.k1.",
        "kvc1.k1",
        "kvc1.k1.AAAA.extra",
        "kvc1.k1.AAAA",  # too short for nonce and tag
        "kvc1.k1.A",  # impossible base64 length
        "kvc1.k1.AAAA==",  # padding is not part of the format
        "kvc1.k1.AA+/AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",  # standard, not URL-safe, alphabet
        "kvc1.k1.AAAA AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "kvc1.k1.ÄÄÄÄAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "kvc1.k1\n.AAAA",
        "kvc1.k 1.AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "kvc1." + "x" * 33 + ".AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA",
        "\x00\ud800",
        "kvc1.k1." + "A" * (MAX_BLOB_CHARS + 1),
        None,
        123,
        b"kvc1.k1.AAAA",
        {"encrypted_content": "x"},
    ],
)
def test_garbage_is_rejected_cleanly(ring: CompactionKeys, blob: Any) -> None:
    assert rejected(ring, blob) in ("malformed", "authentication")


def test_garbage_of_the_right_shape_fails_authentication(ring: CompactionKeys) -> None:
    assert rejected(ring, join("kvc1", "k1", os.urandom(12 + 16 + 40))) == "authentication"
    assert rejected(ring, join("kvc1", "k1", bytes(28))) == "authentication"


def test_over_long_blob_is_refused_before_decoding(
    ring: CompactionKeys, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_decoding(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("decoded an over-long blob")

    monkeypatch.setattr(compaction_keys.base64, "b64decode", no_decoding)
    assert rejected(ring, "kvc1.k1." + "A" * MAX_BLOB_CHARS) == "malformed"


def test_messages_distinguish_only_three_reasons(ring: CompactionKeys) -> None:
    blob = ring.seal(PAYLOAD, tenant=TENANT, model=MODEL)
    version, key_id, raw = split(blob)
    messages = set()
    for bad, kwargs in [
        ("garbage", {}),
        (join(version, "gone", raw), {}),
        (blob, {"tenant": "other"}),
        (blob, {"model": "other"}),
        (join(version, key_id, flip(raw, 0)), {}),
    ]:
        with pytest.raises(CompactionRejectedError) as info:
            ring.open(bad, **{"tenant": TENANT, "model": MODEL, **kwargs})
        messages.add(str(info.value))
        assert info.value.param == "encrypted_content"  # the default
    assert len(messages) == 3


def test_seal_refuses_what_open_would_refuse(ring: CompactionKeys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compaction_keys, "MAX_BLOB_CHARS", 200)
    with pytest.raises(ValueError, match="too large"):
        ring.seal({"text": "x" * 300}, tenant=TENANT, model=MODEL)


def test_unusual_tenants_and_models(ring: CompactionKeys) -> None:
    for tenant, model in [("", ""), ('te"nant', "m\\odel"), ("ténant", "模型"), ("a\ud800", "b")]:
        blob = ring.seal({}, tenant=tenant, model=model)
        assert ring.open(blob, tenant=tenant, model=model) == {}
