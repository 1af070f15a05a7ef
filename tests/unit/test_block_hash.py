"""Chained block hashing: the canonical encoding, the chain, incremental use, determinism."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.block_hash import BlockHasher, hash_block, hash_token_blocks, hex_hash, root_hash

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENS = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 and a tail of 8
# hash_block(root_hash("kvrelay-test"), [1, 2, 3, 4], b"salt")
PINNED_DIGEST = "2b6d3821f59ea3b47642d96943403a89637bf2cd1d22bb06db1f026b9c5bb3b1"


def spec_root(fingerprint: str) -> bytes:
    return hashlib.sha256(b"kvrelay-block-root/v1\x00" + fingerprint.encode("utf-8")).digest()


def spec_block(parent: bytes, token_ids: list[int], cache_salt: bytes) -> bytes:
    """The encoding, written out independently of the module: docs/block-hashing.md."""
    encoded = b"KVB1" + parent + struct.pack("<I", len(cache_salt)) + cache_salt
    encoded += struct.pack("<I", len(token_ids)) + struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256(encoded).digest()


def test_block_hash_matches_the_written_spec() -> None:
    root = root_hash("smollm2-135m@abc")
    assert root == spec_root("smollm2-135m@abc")
    tokens = [0, 1, 255, 256, 65_535, 65_536, 2**32 - 1]
    assert hash_block(root, tokens, b"tenant-a") == spec_block(root, tokens, b"tenant-a")
    assert hash_block(root, tokens) == spec_block(root, tokens, b"")


def test_block_hash_known_answer_is_pinned() -> None:
    # Pinned so that a change to both the module and the spec above still fails: caches and routers
    # in a running fleet depend on this exact value.
    digest = hash_block(root_hash("kvrelay-test"), [1, 2, 3, 4], b"salt")
    assert digest.hex() == spec_block(spec_root("kvrelay-test"), [1, 2, 3, 4], b"salt").hex()
    assert digest.hex() == PINNED_DIGEST


def test_different_fingerprints_give_different_hashes() -> None:
    assert root_hash("model@v1") != root_hash("model@v2")
    assert hash_token_blocks(root_hash("model@v1"), TOKENS, 16) != hash_token_blocks(
        root_hash("model@v2"), TOKENS, 16
    )


def test_different_extra_keys_give_different_hashes_in_every_block() -> None:
    root = root_hash("m")
    tenant_a = hash_token_blocks(root, TOKENS, 16, b"tenant-a")
    tenant_b = hash_token_blocks(root, TOKENS, 16, b"tenant-b")
    unsalted = hash_token_blocks(root, TOKENS, 16)
    for a, b, none in zip(tenant_a, tenant_b, unsalted, strict=True):
        assert len({a, b, none}) == 3


def test_extra_key_is_mixed_into_each_block_not_only_the_first() -> None:
    root = root_hash("m")
    parent = hash_block(root, TOKENS[:16])
    assert hash_block(parent, TOKENS[16:32], b"salt") != hash_block(parent, TOKENS[16:32])


def test_changing_block_zero_changes_every_later_hash() -> None:
    root = root_hash("m")
    original = hash_token_blocks(root, TOKENS, 8)
    changed = hash_token_blocks(root, [TOKENS[0] + 1, *TOKENS[1:]], 8)
    assert len(original) == 5
    assert all(a != b for a, b in zip(original, changed, strict=True))


def test_identical_prefixes_share_hashes() -> None:
    root = root_hash("m")
    first = hash_token_blocks(root, [*TOKENS[:32], 1, 2, 3], 16)
    second = hash_token_blocks(root, [*TOKENS[:32], 9, 9, 9, 9], 16)
    assert first == second == hash_token_blocks(root, TOKENS[:32], 16)


def test_partial_tail_is_not_hashed() -> None:
    root = root_hash("m")
    assert len(hash_token_blocks(root, TOKENS, 16)) == 2
    assert hash_token_blocks(root, TOKENS[:15], 16) == []
    assert hash_token_blocks(root, TOKENS, 16) == hash_token_blocks(root, TOKENS[:32], 16)


def test_batch_hashes_chain_block_by_block() -> None:
    root = root_hash("m")
    first = hash_block(root, TOKENS[:16], b"k")
    second = hash_block(first, TOKENS[16:32], b"k")
    assert hash_token_blocks(root, TOKENS, 16, b"k") == [first, second]


def test_incremental_hasher_matches_batch_and_returns_only_new_hashes() -> None:
    root = root_hash("m")
    hasher = BlockHasher(root, 4, b"k")
    seen: list[bytes] = []
    for end in [0, 3, 4, 5, 11, 12, 12, 30, len(TOKENS)]:
        new = hasher.update(TOKENS[:end])
        assert new == hash_token_blocks(root, TOKENS[:end], 4, b"k")[len(seen) :]
        seen.extend(new)
        assert hasher.hashes == seen
    assert hasher.hashes == hash_token_blocks(root, TOKENS, 4, b"k")


def test_incremental_hasher_never_rereads_hashed_blocks() -> None:
    hasher = BlockHasher(root_hash("m"), 4)
    hasher.update(TOKENS[:8])
    # Changing already-hashed tokens has no effect: only tokens past the last full block are read.
    assert hasher.update([0] * 8 + TOKENS[8:12]) == hash_token_blocks(root_hash("m"), TOKENS[:12], 4)[2:]


def test_incremental_hasher_refuses_a_shrunk_token_list() -> None:
    hasher = BlockHasher(root_hash("m"), 4)
    hasher.update(TOKENS[:8])
    with pytest.raises(ValueError, match="shrank"):
        hasher.update(TOKENS[:7])


def test_bad_inputs_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        hash_block(b"short", [1])
    with pytest.raises(ValueError, match="block_size"):
        hash_token_blocks(root_hash("m"), TOKENS, 0)
    with pytest.raises(OverflowError):
        hash_block(root_hash("m"), [-1])
    with pytest.raises(OverflowError):
        hash_block(root_hash("m"), [2**32])


def test_hex_hash_is_short() -> None:
    assert hex_hash(root_hash("m")) == root_hash("m").hex()[:16]


def test_another_process_computes_the_same_hashes() -> None:
    code = (
        "from services.common.block_hash import hash_token_blocks, root_hash\n"
        "print(b''.join(hash_token_blocks(root_hash('m@1'), list(range(100, 140)), 16, b'k')).hex())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == b"".join(hash_token_blocks(root_hash("m@1"), TOKENS, 16, b"k")).hex()
