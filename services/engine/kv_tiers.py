"""The engine's side of the KV tiers below its pool (services/kvcache, docs/kv-tiers.md): writing through.

As a request leaves the scheduler (finished, or handed off by a prefill replica), every full segment of
what it computed, prompt and output alike, is copied out of the pool on the engine thread, before its blocks
go back, and queued for the tiers; the writer's thread encodes and stores it. A segment is `segment_tokens`
tokens (a multiple of the block size) starting at a multiple of it, so a conversation's next turn, whose
prompt holds this turn's prompt and output, finds the same keys. Not copied: a segment that reaches past the
blocks committed to the prefix cache (the last sampled token has no KV yet), one whose blocks a sliding
window freed, and one the writer queued lately (under this namespace and tenant, the same bytes).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from services.common.config import KvTiersConfig
from services.common.errors import ConfigError
from services.engine.scheduling.block_pool import NO_BLOCK
from services.engine.scheduling.request import Request
from services.kvcache.disk_tier import DiskTier
from services.kvcache.redis_tier import RedisTier
from services.kvcache.segment import Namespace, encode, segment_key
from services.kvcache.tier import Tier
from services.kvcache.tier_set import SegmentWriter, TierSet

log = logging.getLogger(__name__)
PASSWORD_ENV = "KVRELAY_KV_TIERS_PASSWORD"

ReadKV = Callable[[list[int], int, int], torch.Tensor]  # (block_ids, start, end) -> [L, T, 2, H, D]


class SegmentWrites:
    """What `Scheduler.on_finish` calls: the full segments of a leaving request, queued for the tiers."""

    def __init__(
        self, namespace: Namespace, segment_tokens: int, writer: SegmentWriter, read_kv: ReadKV
    ) -> None:
        if segment_tokens % namespace.block_size:
            raise ConfigError(
                f"kv_tiers.segment_tokens ({segment_tokens}) must be a multiple of engine.block_size "
                f"({namespace.block_size})"
            )
        self.namespace = namespace
        self.segment_tokens = segment_tokens
        self.writer = writer
        self.read_kv = read_kv
        self.num_segments_queued = 0

    def on_finish(self, request: Request) -> None:
        block_size, size = self.namespace.block_size, self.segment_tokens
        num_committed_tokens = min(request.num_committed_blocks, len(request.block_hashes)) * block_size
        for start in range(0, num_committed_tokens - size + 1, size):
            first, last = start // block_size, (start + size) // block_size
            if NO_BLOCK in request.block_ids[first:last]:
                continue  # freed below a sliding window
            hashes = request.block_hashes[first:last]
            key = segment_key(self.namespace, request.cache_salt, hashes[-1])
            if self.writer.knows(key):
                continue
            kv = self.read_kv(request.block_ids, start, start + size)  # [L, size, 2, H, D], a copy
            value = partial(_value, self.namespace, request.cache_salt, start, hashes, kv)
            if self.writer.submit(key, size * self.namespace.bytes_per_token, value):
                self.num_segments_queued += 1

    def close(self, timeout: float = 5.0) -> None:
        self.writer.close(timeout)


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
        timeout_s = config.timeout_ms / 1000
        tiers.append(
            RedisTier.from_url(config.shared_url, config.ttl_s, timeout_s, environ.get(PASSWORD_ENV))
        )
    return TierSet(tiers)
