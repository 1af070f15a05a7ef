"""A checksum of a KV buffer computed where the buffer lives: on the GPU for CUDA tensors, no host copy.

zlib's CRC-32 (what the grpc and torch transports send) runs on the host, so checking device-to-device
KV with it would copy every byte back through host memory: the very thing the ipc transport avoids.
This one is a Fletcher-style pair over 32-bit little-endian words `w_i` (the buffer zero-padded to a
multiple of 4 bytes), modulo the prime P = 2**31 - 1:

    A = sum(w_i) mod P          B = sum((i + 1) * w_i) mod P          checksum = A << 32 | B

A catches any single changed word, B also catches words swapped or shifted. Every step is exact integer
arithmetic that never overflows int64 (rows of ROW_WORDS words; per-row sums reduced mod P before they
are combined), so CPU and GPU give the same value whatever order the reduction runs in. `reference` is
the slow twin in plain Python integers, and tests check that the two agree.

`kv_checksum` is the transports' rule for which of the two a chunk gets (`ChecksumKind`): this one where
the bytes are on a GPU, zlib's CRC-32 where they are in host memory (several times faster there).
"""

from __future__ import annotations

from enum import StrEnum

import torch

from services.kvtransfer.chunks import checksum

PRIME = 2**31 - 1
ROW_WORDS = 1024  # per-row sums stay below 2**52
SLICE_ROWS = 4096  # rows per pass: bounds each int64 temporary to 32 MiB


def device_checksum(flat: torch.Tensor) -> int:
    """The checksum of a flat uint8 tensor's bytes, on its own device (one read-back of two integers)."""
    if flat.dtype != torch.uint8 or flat.dim() != 1:
        raise ValueError(f"expected a flat uint8 tensor, got {flat.dtype} {tuple(flat.shape)}")
    words = _words(flat)  # [num_rows, ROW_WORDS] int32
    weights = torch.arange(1, ROW_WORDS + 1, dtype=torch.int64, device=flat.device)  # [ROW_WORDS]
    total_a = torch.zeros((), dtype=torch.int64, device=flat.device)
    total_b = torch.zeros((), dtype=torch.int64, device=flat.device)
    for first in range(0, words.shape[0], SLICE_ROWS):
        rows = words[first : first + SLICE_ROWS].to(torch.int64).bitwise_and_(0xFFFFFFFF)  # [n, ROW_WORDS]
        row_a = rows.sum(dim=1) % PRIME  # [n]
        row_b = (rows * weights).sum(dim=1) % PRIME  # [n]
        # word i = r * ROW_WORDS + j contributes (r * ROW_WORDS + j + 1) * w: row r adds B_r + offset_r * A_r
        index = torch.arange(first, first + rows.shape[0], dtype=torch.int64, device=flat.device)
        offset = (index * ROW_WORDS) % PRIME  # [n]
        total_a = (total_a + row_a.sum()) % PRIME
        total_b = (total_b + row_b.sum() + ((offset * row_a) % PRIME).sum()) % PRIME
    pair = torch.stack([total_a, total_b]).tolist()  # the one read-back
    return (int(pair[0]) << 32) | int(pair[1])


class ChecksumKind(StrEnum):
    CRC32 = "crc32"  # zlib's, over host bytes
    DEVICE = "device"  # this module's, computed on the bytes' own device


def checksum_kind(device: torch.device) -> ChecksumKind:
    """The checksum for KV bytes on `device`: DEVICE on a GPU (no host copy), CRC32 in host memory."""
    return ChecksumKind.DEVICE if device.type == "cuda" else ChecksumKind.CRC32


def kv_checksum(flat: torch.Tensor, kind: ChecksumKind | None = None) -> int:
    """`kind`'s checksum of flat uint8 KV bytes (None: `checksum_kind` of their device). CRC32 of bytes on
    a GPU needs a host copy of them (only for a peer that sends CRC32 from a GPU)."""
    if (kind or checksum_kind(flat.device)) == ChecksumKind.DEVICE:
        return device_checksum(flat)
    host = flat if flat.device.type == "cpu" else flat.cpu()
    return checksum(host.numpy().data)


def _words(flat: torch.Tensor) -> torch.Tensor:
    """The bytes as 32-bit words, zero-padded into rows: [num_rows, ROW_WORDS] int32 (signed; widened and
    masked to unsigned per slice)."""
    num_words = -(-flat.numel() // 4)
    num_rows = max(1, -(-num_words // ROW_WORDS))
    padded = torch.zeros(num_rows * ROW_WORDS * 4, dtype=torch.uint8, device=flat.device)
    padded[: flat.numel()] = flat
    return padded.view(torch.int32).view(num_rows, ROW_WORDS)


def reference(data: bytes) -> int:
    """The same checksum in plain Python integers (slow; for tests)."""
    data = data + bytes(-len(data) % 4)
    total_a = total_b = 0
    for i in range(0, len(data), 4):
        word = int.from_bytes(data[i : i + 4], "little")
        total_a = (total_a + word) % PRIME
        total_b = (total_b + (i // 4 + 1) * word) % PRIME
    return (total_a << 32) | total_b
