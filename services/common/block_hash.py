"""Chained hashes of full KV blocks, shared by prefill, decode and the router. Pure and torch-free.

A block's hash names its KV content: the model (through the root), every token before it (through
the parent hash) and the tenant salt (the extra key). Equal hashes mean reusable KV.

Canonical encoding of one block (all integers unsigned 32-bit little-endian), hashed with SHA-256:

    b"KVB1" ‖ parent (32 bytes) ‖ len(cache_salt) ‖ cache_salt ‖ num_tokens ‖ token_ids[0] ‖ …

The parent of block 0 is `root_hash(model_fingerprint)`, so a new fingerprint never reuses old
cache. Only full blocks are hashed; the partial tail has no hash until it fills.

The extra key (the tenant salt) is mixed into every block, not only the first. The chain alone
would carry it along, but then a block's hash would mean something only next to its ancestors.
With the salt in each block, every hash is self-contained: the router's index, and anyone reading
a KV event of (parent, token_ids, cache_salt), can check one block on its own, and tenant
isolation does not rest on the chain being intact. The encoding is also the same for every block,
with no special case for block 0. See docs/block-hashing.md.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

HASH_SIZE = 32
ROOT_DOMAIN = b"kvrelay-block-root/v1\x00"
BLOCK_MAGIC = b"KVB1"

_U32 = struct.Struct("<I")
# The array typecode holding an unsigned 32-bit integer on this platform ("I" everywhere we run).
_U32_TYPECODE = next(code for code in "IL" if array(code).itemsize == 4)
_MAX_EXTRA_KEY_LEN = 2**32 - 1


def root_hash(model_fingerprint: str) -> bytes:
    """The parent of block 0 for a model: SHA-256 of the domain tag and the fingerprint's UTF-8."""
    return hashlib.sha256(ROOT_DOMAIN + model_fingerprint.encode("utf-8")).digest()


def hash_block(parent: bytes, token_ids: Sequence[int], cache_salt: bytes = b"") -> bytes:
    """The 32-byte hash of one block whose predecessor hashed to `parent`. Any number of tokens."""
    _check_parent(parent)
    return _digest(parent, _extra_header(cache_salt), _token_bytes(token_ids), len(token_ids))


def hash_token_blocks(
    root: bytes, token_ids: Sequence[int], block_size: int, cache_salt: bytes = b""
) -> list[bytes]:
    """Chained hashes of every full block of `token_ids`, starting from `root`; the tail is skipped."""
    _check_parent(root)
    _check_block_size(block_size)
    num_blocks = len(token_ids) // block_size
    return _chain(root, token_ids[: num_blocks * block_size], block_size, _extra_header(cache_salt))


def request_salt(cache_salt: bytes, encoder_token_ids: Sequence[int] = ()) -> bytes:
    """A request's extra key: the tenant's salt, and for an encoder-decoder request a digest of its
    encoder input too. Every decoder starts from the same token, so its KV is the same only under the
    same input: with the input in every hash, decoder prefixes are shared only between requests that
    share it (and the router's overlap matches what the replicas cache)."""
    if not encoder_token_ids:
        return cache_salt
    return cache_salt + b"\x00encoder:" + hashlib.sha256(_token_bytes(encoder_token_ids)).digest()


def hex_hash(block_hash: bytes) -> str:
    """A short hex form for logs: the first 8 bytes."""
    return block_hash[:8].hex()


class BlockHasher:
    """Hashes one request's blocks as they fill. `hashes[i]` is the hash of block i.

    Each block is hashed once: `update` looks only at tokens past the last full block it saw.
    Token lists are append-only, so earlier tokens are never re-read.
    """

    def __init__(self, root: bytes, block_size: int, cache_salt: bytes = b"") -> None:
        _check_parent(root)
        _check_block_size(block_size)
        self.root = root
        self.block_size = block_size
        self.hashes: list[bytes] = []
        self._extra_header = _extra_header(cache_salt)

    @property
    def num_hashed_tokens(self) -> int:
        return len(self.hashes) * self.block_size

    def update(self, token_ids_all: Sequence[int]) -> list[bytes]:
        """Hash blocks newly filled in `token_ids_all` (the request's whole token list so far);
        append them to `hashes` and return only the new ones."""
        start = self.num_hashed_tokens
        if len(token_ids_all) < start:
            raise ValueError(f"token list shrank to {len(token_ids_all)} tokens; {start} were already hashed")
        end = len(token_ids_all) // self.block_size * self.block_size
        if end == start:
            return []
        parent = self.hashes[-1] if self.hashes else self.root
        new_hashes = _chain(parent, token_ids_all[start:end], self.block_size, self._extra_header)
        self.hashes.extend(new_hashes)
        return new_hashes


def _chain(parent: bytes, token_ids: Sequence[int], block_size: int, extra_header: bytes) -> list[bytes]:
    """Hashes of consecutive full blocks; `len(token_ids)` is a multiple of `block_size`."""
    data = _token_bytes(token_ids)
    block_bytes = 4 * block_size
    hashes: list[bytes] = []
    for offset in range(0, len(data), block_bytes):
        parent = _digest(parent, extra_header, data[offset : offset + block_bytes], block_size)
        hashes.append(parent)
    return hashes


def _digest(parent: bytes, extra_header: bytes, token_bytes: bytes, num_tokens: int) -> bytes:
    return hashlib.sha256(BLOCK_MAGIC + parent + extra_header + _U32.pack(num_tokens) + token_bytes).digest()


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token IDs as little-endian u32; OverflowError for a negative or too large ID."""
    tokens = array(_U32_TYPECODE, token_ids)
    if sys.byteorder == "big":
        tokens.byteswap()
    return tokens.tobytes()


def _extra_header(cache_salt: bytes) -> bytes:
    if len(cache_salt) > _MAX_EXTRA_KEY_LEN:
        raise ValueError(f"cache_salt is {len(cache_salt)} bytes; at most {_MAX_EXTRA_KEY_LEN} fit")
    return _U32.pack(len(cache_salt)) + bytes(cache_salt)


def _check_parent(parent: bytes) -> None:
    if len(parent) != HASH_SIZE:
        raise ValueError(f"a parent hash is {HASH_SIZE} bytes, got {len(parent)}")


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be at least 1, got {block_size}")
