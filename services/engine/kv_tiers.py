"""The engine's side of the KV tiers below its pool (services/kvcache, docs/kv-tiers.md): writing through,
and reading back at admission.

As a request leaves the scheduler (finished, or handed off by a prefill replica), every full segment of
what it computed, prompt and output alike, is copied out of the pool on the engine thread, before its blocks
go back, and queued for the tiers; the writer's thread encodes and stores it. A segment is `segment_tokens`
tokens (a multiple of the block size) starting at a multiple of it, so a conversation's next turn, whose
prompt holds this turn's prompt and output, finds the same keys. Not copied: a segment that reaches past the
blocks committed to the prefix cache (the last sampled token has no KV yet), one whose blocks a sliding
window freed, and one the writer queued lately (under this namespace and tenant, the same bytes).

Reading back (`SegmentReads`, the scheduler's `fetch_below`): when a request is admitted, the segments after
the pool's own prefix hit are looked up in the tiers, fastest first, up to the first one missing or the
deadline, and never the segment holding the prompt's last token (it is recomputed for its logits). Their KV
goes into the request's new blocks before its first chunk, which then starts after them. For now the lookup
runs on the engine thread, bounded by `timeout_s` (a tier's own timeout bounds each call).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from services.common.config import KvTiersConfig
from services.engine.kv_export import KV_DTYPES
from services.engine.scheduling.block_pool import NO_BLOCK
from services.engine.scheduling.request import Request
from services.kvcache.disk_tier import DiskTier
from services.kvcache.segment import Namespace, decode, encode, segment_key
from services.kvcache.tier import Tier
from services.kvcache.tier_set import SegmentWriter, TierSet

log = logging.getLogger(__name__)
PASSWORD_ENV = "KVRELAY_KV_TIERS_PASSWORD"

ReadKV = Callable[[list[int], int, int], torch.Tensor]  # (block_ids, start, end) -> [L, T, 2, H, D]
WriteKV = Callable[[list[int], int, torch.Tensor], None]  # (block_ids, start, [L, T, 2, H, D])


class SegmentWrites:
    """What `Scheduler.on_finish` calls: the full segments of a leaving request, queued for the tiers."""

    def __init__(
        self, namespace: Namespace, segment_tokens: int, writer: SegmentWriter, read_kv: ReadKV
    ) -> None:
        self.namespace = namespace
        self.segment_tokens = segment_tokens
        self.writer = writer
        self.read_kv = read_kv

    def on_finish(self, request: Request) -> None:
        block_size, size = self.namespace.block_size, self.segment_tokens
        num_committed_tokens = min(request.num_committed_blocks, len(request.block_hashes)) * block_size
        for start in range(0, num_committed_tokens - size + 1, size):
            blocks = _blocks_of(start, size, block_size)
            if NO_BLOCK in request.block_ids[blocks]:
                continue  # freed below a sliding window
            hashes = request.block_hashes[blocks]
            key = segment_key(self.namespace, request.cache_salt, hashes[-1])
            if self.writer.knows(key):
                continue
            kv = self.read_kv(request.block_ids, start, start + size)  # [L, size, 2, H, D], a copy
            value = partial(_value, self.namespace, request.cache_salt, start, hashes, kv)
            self.writer.submit(key, size * self.namespace.bytes_per_token, value)

    def close(self, timeout: float = 5.0) -> None:
        self.writer.close(timeout)


class _Fetched:
    """KV found below the pool for `num_tokens` tokens, ready to be placed into a request's blocks."""

    def __init__(self, kv: torch.Tensor, write_kv: WriteKV) -> None:
        self.kv = kv  # [num_layers, num_tokens, 2, num_kv_heads, head_dim]
        self.num_tokens = kv.shape[1]
        self.write_kv = write_kv

    def place(self, block_ids: list[int], start: int) -> None:
        self.write_kv(block_ids, start, self.kv)


class SegmentReads:
    """What `Scheduler.fetch_below` calls: the segments after a request's cached prefix, from the tiers."""

    def __init__(
        self,
        namespace: Namespace,
        segment_tokens: int,
        tiers: TierSet,
        write_kv: WriteKV,
        timeout_s: float,
        device: torch.device,
    ) -> None:
        self.namespace = namespace
        self.segment_tokens = segment_tokens
        self.tiers = tiers
        self.write_kv = write_kv
        self.timeout_s = timeout_s
        self.device = device
        self.num_tokens_fetched = 0

    def fetch_below(self, request: Request, num_cached_tokens: int) -> _Fetched | None:
        size, block_size = self.segment_tokens, self.namespace.block_size
        num_cacheable = (request.num_tokens - 1) // block_size * block_size  # the last token is recomputed
        first, end = (
            num_cached_tokens // size,
            min(num_cacheable, len(request.block_hashes) * block_size) // size,
        )
        if first >= end:
            return None
        spans = [request.block_hashes[_blocks_of(s * size, size, block_size)] for s in range(first, end)]
        keys = [segment_key(self.namespace, request.cache_salt, hashes[-1]) for hashes in spans]

        def check(index: int, value: bytes) -> bytes:
            start = (first + index) * size
            return decode(value, self.namespace, request.cache_salt, start, spans[index])

        payloads = self.tiers.fetch(keys, check, time.monotonic() + self.timeout_s)
        if not payloads:
            return None
        shape = (self.namespace.num_layers, size, 2, self.namespace.num_kv_heads, self.namespace.head_dim)
        dtype = KV_DTYPES[self.namespace.kv_dtype]
        kv = torch.cat([torch.frombuffer(bytearray(p), dtype=dtype).view(shape) for p in payloads], dim=1)
        kv = kv[:, num_cached_tokens - first * size :]  # the pool already holds the segment's first blocks
        self.num_tokens_fetched += kv.shape[1]
        return _Fetched(kv.to(self.device), self.write_kv)


def _blocks_of(start: int, size: int, block_size: int) -> slice:
    """The block indices of the segment of `size` tokens starting at token `start`."""
    return slice(start // block_size, (start + size) // block_size)


def _value(
    namespace: Namespace, cache_salt: bytes, start: int, hashes: list[bytes], kv: torch.Tensor
) -> bytes:
    """The stored value of one segment (on the writer's thread): its KV's raw bytes under their header."""
    payload = kv.contiguous().cpu().view(torch.uint8).numpy().tobytes()  # little-endian on every host we run
    return encode(namespace, cache_salt, start, hashes, payload)


def build_tiers(config: KvTiersConfig, environ: dict[str, str]) -> TierSet:
    """The configured tiers, fastest first: the node's disk, then the shared Redis."""
    tiers: list[Tier] = []
    if config.disk_path is not None:
        tiers.append(DiskTier(Path(config.disk_path), config.disk_capacity_mb * 2**20))
    if config.shared_url is not None:
        from services.kvcache.redis_tier import RedisTier  # redis only where a shared tier is configured

        timeout_s = config.timeout_ms / 1000
        tiers.append(
            RedisTier.from_url(config.shared_url, config.ttl_s, timeout_s, environ.get(PASSWORD_ENV))
        )
    return TierSet(tiers)
