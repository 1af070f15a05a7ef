"""The host-memory tier: segments in this worker's RAM, bounded in bytes, least recently used out first.

Values are the same self-describing bytes the other tiers store, so a reader checks them the same way. It
lives and dies with the worker, and on a GPU worker it is the fastest tier below the device pool. On a CPU
worker the pool is host memory already, so this tier is a second buffer there (off by default): it keeps
segments the pool has evicted, at the cost of copying them on the way in.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque

from services.kvcache.tier import EVICTED_KEPT


class HostTier:
    name = "host"
    outlives_worker = False
    ttl_s = None

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.evictions = 0
        self._values: OrderedDict[str, bytes] = OrderedDict()  # least recently used first
        self._evicted: deque[str] = deque(maxlen=EVICTED_KEPT)
        self._used = 0
        self._lock = threading.Lock()  # the writer thread puts, lookup threads get

    def get(self, key: str) -> bytes | None:
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def put(self, key: str, value: bytes, ttl_s: int | None = None) -> bool:
        if len(value) > self.capacity_bytes:
            return False
        with self._lock:
            if key in self._values:
                return False
            self._values[key] = value
            self._used += len(value)
            while self._used > self.capacity_bytes:
                key, evicted = self._values.popitem(last=False)
                self._used -= len(evicted)
                self.evictions += 1
                self._evicted.append(key)
            return True

    def contains(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def delete(self, key: str) -> None:
        with self._lock:
            value = self._values.pop(key, None)
            if value is not None:
                self._used -= len(value)

    def used_bytes(self) -> int | None:
        return self._used

    def take_evicted(self) -> list[str]:
        with self._lock:
            keys = list(self._evicted)
            self._evicted.clear()
            return keys
