"""The local-disk tier: one file per segment under a directory of the node, bounded in bytes, kept across
worker restarts, safe when several workers share the directory.

A value is written to a temporary file beside its final path and renamed into place (`os.replace` is
atomic on one filesystem), so a reader sees a whole value or none, and two workers writing the same key
write the same bytes. A hit touches the file's modification time; when the directory holds more than
`capacity_bytes`, `put` removes the least recently used files down to 90% of it. Another worker may remove a
file between a `contains` and a `get`: that is a miss. Keys are made of hex digits, `-` and `:`; the file
name is the key with `:` as `_`, under a folder per namespace.

The directory is scanned (a `stat` per file) only when this worker's count of the bytes there, its last
scan plus its own writes since, passes the capacity, or every `RESCAN_WRITES` writes (the node's other
workers write too): not on every write.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections import deque
from pathlib import Path

from services.kvcache.tier import EVICTED_KEPT

LOW_WATER = 0.9
SUFFIX = ".kvs"
RESCAN_WRITES = 64


class DiskTier:
    name = "disk"
    outlives_worker = True
    ttl_s = None

    def __init__(self, root: Path, capacity_bytes: int) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.evictions = 0  # files this worker removed for room
        self._evicted: deque[str] = deque(maxlen=EVICTED_KEPT)  # their keys, until `take_evicted`
        self._used = self._scan_used()  # bytes there at the last scan, plus this worker's writes since
        self._writes_since_scan = 0

    def _path(self, key: str) -> Path:
        parts = key.split(":")
        if len(parts) != 4 or not all(p and all(c in "0123456789abcdefkv-" for c in p) for p in parts):
            raise ValueError(f"not a segment key: {key!r}")
        return self.root / parts[1] / ("_".join(parts) + SUFFIX)

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            value = path.read_bytes()
            os.utime(path)  # a hit is recent
        except FileNotFoundError:
            return None
        return value

    def put(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        """`ttl_s` is not kept: a file lives until the directory's capacity pushes it out."""
        path = self._path(key)
        if path.exists():
            with contextlib.suppress(
                FileNotFoundError
            ):  # another worker removed it: the next write stores it
                os.utime(path)  # asked for again: now recently used
            return False
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(value)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        self._used += len(value)
        self._writes_since_scan += 1
        if self._used > self.capacity_bytes or self._writes_since_scan >= RESCAN_WRITES:
            self._evict_over_capacity()
        return True

    def contains(self, keys: list[str]) -> list[bool]:
        return [self._path(key).exists() for key in keys]

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def take_evicted(self) -> list[str]:
        keys = []
        while self._evicted:
            keys.append(self._evicted.popleft())
        return keys

    def used_bytes(self) -> int:
        """The bytes in the directory as of the last scan, plus this worker's writes since."""
        return self._used

    def _scan_used(self) -> int:
        return sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[float, int, Path]]:
        files = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            try:
                stat = path.stat()
            except FileNotFoundError:  # another worker evicted it
                continue
            files.append((stat.st_mtime, stat.st_size, path))
        return files

    def _evict_over_capacity(self) -> None:
        files = self._files()
        self._used = sum(size for _, size, _ in files)
        self._writes_since_scan = 0
        if self._used <= self.capacity_bytes:
            return
        for _, size, path in sorted(files):  # oldest first
            path.unlink(missing_ok=True)
            self._used -= size
            self.evictions += 1
            self._evicted.append(path.name.removesuffix(SUFFIX).replace("_", ":"))
            if self._used <= LOW_WATER * self.capacity_bytes:
                return
