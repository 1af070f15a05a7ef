"""The engine's side of the KV tiers below its pool (services/kvcache, docs/kv-tiers.md): writing through,
and reading back at admission.

As a request leaves the scheduler (finished, or handed off by a prefill replica), every full segment of
what it computed, prompt and output alike, is copied out of the pool on the engine thread, before its blocks
go back, and queued for the tiers; the writer's thread encodes and stores it. A segment is `segment_tokens`
tokens (a multiple of the block size) starting at a multiple of it, so a conversation's next turn, whose
prompt holds this turn's prompt and output, finds the same keys. Not copied: a segment that reaches past the
blocks committed to the prefix cache (the last sampled token has no KV yet), one whose blocks a sliding
window freed, and one the writer queued lately (under this namespace and tenant, the same bytes) as far
and as long. A client's cache breakpoints (engine_input.CacheBreakpoint) decide how far and how long: see
`SegmentWrites`; a breakpoint inside a segment adds a tail, the segment's part up to it.

Reading back (`SegmentReads`): when a request arrives (`Scheduler.add`), the segments after the pool's
own prefix hit are looked up on a lookup thread, never the engine's: in the tiers, fastest first, each
asked only while the cost model (kvcache/costs.py) expects it to beat recomputing, up to the first segment
missing, or the deadline, then the longest of the request's own tails in the segment where that run
stopped, and never the segment holding the prompt's last token (it is recomputed for its logits).
Meanwhile the scheduler admits others; the request waits until its lookup ends or its deadline passes
(then it recomputes, and the lookup's result is dropped). At admission its KV goes into the request's new
blocks before its first chunk, which then starts after them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from services.common.config import KV_TIERS_PASSWORD_ENV, KvTiersConfig
from services.common.outputs import FinishReason
from services.engine.kv_export import KV_DTYPES
from services.engine.scheduling.block_pool import NO_BLOCK
from services.engine.scheduling.request import Request, SeqId
from services.kvcache.disk_tier import DiskTier
from services.kvcache.host_tier import HostTier
from services.kvcache.segment import Namespace, decode, encode, segment_key
from services.kvcache.tier import Tier
from services.kvcache.tier_set import (
    Hold,
    SegmentRef,
    SegmentSize,
    SegmentWriter,
    TierEvent,
    TierReport,
    TierSet,
)

log = logging.getLogger(__name__)

ReadKV = Callable[[list[int], int, int], torch.Tensor]  # (block_ids, start, end) -> [L, T, 2, H, D]
WriteKV = Callable[[list[int], int, torch.Tensor], None]  # (block_ids, start, [L, T, 2, H, D])


class SegmentWrites:
    """What `Scheduler.on_finish` calls: the full segments of a leaving request, queued for the tiers.

    A segment up to one of the request's cache breakpoints goes through to every tier, kept at least as
    long as the longest breakpoint at or after its end asks; one past them all goes through too when
    `write_through` is "always", else to the tiers that die with the worker only. A breakpoint inside a
    segment adds the segment's part up to it, a tail: [start of its segment, the breakpoint), whole blocks."""

    def __init__(
        self,
        namespace: Namespace,
        segment_tokens: int,
        writer: SegmentWriter,
        read_kv: ReadKV,
        write_through: bool = True,
        ttl_s: int = 0,
    ) -> None:
        """`ttl_s`: the tiers' own lifetime; a breakpoint asking no longer is written as any segment."""
        self.namespace = namespace
        self.segment_tokens = segment_tokens
        self.writer = writer
        self.read_kv = read_kv
        self.write_through = write_through
        self.ttl_s = ttl_s
        # Where a segment not written through can go: a tier that dies with the worker (the host tier).
        self.keeps_unheld = any(not tier.outlives_worker for tier in writer.tiers.tiers)

    def on_finish(self, request: Request) -> None:
        block_size, size = self.namespace.block_size, self.segment_tokens
        num_committed_tokens = min(request.num_committed_blocks, len(request.block_hashes)) * block_size
        ends = list(range(size, num_committed_tokens + 1, size))
        ends += [end for end in _tails(request, size, block_size) if end <= num_committed_tokens]
        for end in ends:
            blocks = _segment_ending(end, size, block_size)
            start = blocks.start * block_size
            if NO_BLOCK in request.block_ids[blocks]:
                continue  # freed below a sliding window
            hashes = request.block_hashes[blocks]
            key = segment_key(self.namespace, request.cache_salt, hashes[-1])
            hold = self._hold(request, end)
            if self.writer.knows(key, hold) or not (hold.through or self.keeps_unheld):
                continue
            kv = self.read_kv(request.block_ids, start, end)  # [L, end - start, 2, H, D], a copy
            value = partial(_value, self.namespace, request.cache_salt, start, hashes, kv)
            ref = SegmentRef(hashes[-1], blocks.start, len(hashes))
            self.writer.submit(key, (end - start) * self.namespace.bytes_per_token, value, hold, ref)

    def _hold(self, request: Request, end: int) -> Hold:
        """How the segment ending at token `end` is written: as the breakpoints at or after it ask."""
        ttls = [point.ttl_s for point in request.cache_breakpoints if point.num_tokens >= end]
        if ttls:
            return Hold(through=True, ttl_s=max(ttls) if max(ttls) > self.ttl_s else None)
        return Hold(through=self.write_through)

    def close(self, timeout: float = 5.0) -> None:
        self.writer.close(timeout)


class _Fetched:
    """KV found below the pool for `num_tokens` tokens, placed into a request's blocks at admission."""

    def __init__(self, reads: SegmentReads, seq_id: SeqId, kv: torch.Tensor) -> None:
        self.reads = reads
        self.seq_id = seq_id
        self.kv = kv  # [num_layers, num_tokens, 2, num_kv_heads, head_dim], on the host
        self.num_tokens = kv.shape[1]

    def place(self, block_ids: list[int], start: int) -> None:
        self.reads.placed(self.seq_id, self.num_tokens)
        self.reads.write_kv(block_ids, start, self.kv.to(self.reads.device))


@dataclass
class _Lookup:
    first: int  # the index of the first segment asked for
    future: Future[torch.Tensor | None]  # the KV of the run found, from the first segment's first token
    deadline: float  # on time.monotonic()


class SegmentReads:
    """What `Scheduler` asks at a request's arrival (`look`) and admission (`is_looking`, `found`)."""

    def __init__(
        self,
        namespace: Namespace,
        segment_tokens: int,
        tiers: TierSet,
        write_kv: WriteKV,
        timeout_s: float,
        device: torch.device,
        num_threads: int = 2,
    ) -> None:
        self.namespace = namespace
        self.segment_tokens = segment_tokens
        self.tiers = tiers
        self.write_kv = write_kv
        self.timeout_s = timeout_s
        self.device = device
        self.on_ready: Callable[[], None] | None = None  # called on a lookup thread as each lookup ends
        self._ended = threading.Event()  # set as each lookup ends (`wait_lookups`)
        self._lookups: dict[SeqId, _Lookup] = {}
        self._threads = ThreadPoolExecutor(num_threads, thread_name_prefix="kv-tier-lookup")

    def look(self, request: Request, num_cached_tokens: int) -> None:
        """Start looking up the segments after the pool's hit of `num_cached_tokens` (engine thread)."""
        size, block_size = self.segment_tokens, self.namespace.block_size
        num_cacheable = (request.num_tokens - 1) // block_size * block_size  # the last token is recomputed
        num_cacheable = min(num_cacheable, len(request.block_hashes) * block_size)
        first = num_cached_tokens // size
        end = num_cacheable // size
        tails = {
            tail: request.block_hashes[_segment_ending(tail, size, block_size)]
            for tail in _tails(request, size, block_size)
            if num_cached_tokens < tail <= num_cacheable
        }
        if first >= end and not tails:
            return
        spans = [request.block_hashes[_blocks_of(s * size, size, block_size)] for s in range(first, end)]
        deadline = time.monotonic() + self.timeout_s
        future = self._threads.submit(self._fetch, request.cache_salt, first, spans, tails, deadline)
        self._lookups[request.seq_id] = _Lookup(first, future, deadline)
        future.add_done_callback(self._lookup_ended)

    def _lookup_ended(self, _: Future[torch.Tensor | None]) -> None:
        self._ended.set()
        if self.on_ready is not None:
            self.on_ready()

    def wait_lookups(self, timeout_s: float) -> None:
        """Block until a lookup ends (or `timeout_s`), if any is running: a driver whose step could run
        nothing sleeps here instead of spinning against the lookup threads for the GIL."""
        if any(not lookup.future.done() for lookup in self._lookups.values()):
            self._ended.wait(timeout_s)
        self._ended.clear()

    def is_looking(self, request: Request) -> bool:
        """Whether the request's lookup is still running, within its deadline."""
        lookup = self._lookups.get(request.seq_id)
        return lookup is not None and not lookup.future.done() and time.monotonic() < lookup.deadline

    def found(self, request: Request, num_cached_tokens: int) -> _Fetched | None:
        """The KV its ended lookup found for the tokens after the pool's hit of `num_cached_tokens` now,
        kept until `place`d (an admission that fails for room tries again with it); None: recompute."""
        lookup = self._lookups.get(request.seq_id)
        if lookup is None:
            return None
        if not lookup.future.done():  # past its deadline
            self.forget(request)
            self.tiers.count_lookup(0, late=True)
            return None
        kv = lookup.future.result()
        skip = num_cached_tokens - lookup.first * self.segment_tokens
        if kv is None or not 0 <= skip < kv.shape[1]:  # nothing found, or the pool's hit moved past it
            self.forget(request)
            return None
        return _Fetched(self, request.seq_id, kv[:, skip:])

    def placed(self, seq_id: SeqId, num_tokens: int) -> None:
        self._lookups.pop(seq_id, None)
        self.tiers.count_lookup(num_tokens, late=False)

    def forget(self, request: Request) -> None:
        """Drop the request's lookup (it left, or used it); a running one ends on its own, unread."""
        lookup = self._lookups.pop(request.seq_id, None)
        if lookup is not None:
            lookup.future.cancel()

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _fetch(
        self,
        cache_salt: bytes,
        first: int,
        spans: list[list[bytes]],
        tails: dict[int, list[bytes]],
        deadline: float,
    ) -> torch.Tensor | None:
        """On a lookup thread: the KV of the longest run of the segments found, then of the longest tail
        (`tails`: end -> its blocks' hashes) in the segment where the run stopped, or None."""
        size, bytes_per_token = self.segment_tokens, self.namespace.bytes_per_token
        keys = [segment_key(self.namespace, cache_salt, hashes[-1]) for hashes in spans]

        def check(index: int, value: bytes) -> bytes:
            return decode(value, self.namespace, cache_salt, (first + index) * size, spans[index])

        try:
            payloads = self.tiers.fetch(keys, check, deadline, SegmentSize(size * bytes_per_token, size))
            stop = (first + len(payloads)) * size
            for end in sorted((end for end in tails if (end - 1) // size * size == stop), reverse=True):
                hashes = tails[end]
                key = segment_key(self.namespace, cache_salt, hashes[-1])
                check_tail = partial(_check_tail, self.namespace, cache_salt, stop, hashes)
                weight = SegmentSize((end - stop) * bytes_per_token, end - stop)
                if tail := self.tiers.fetch([key], check_tail, deadline, weight):
                    payloads += tail
                    break
            if not payloads:
                return None
            ns = self.namespace
            shape = (ns.num_layers, -1, 2, ns.num_kv_heads, ns.head_dim)
            dtype = KV_DTYPES[ns.kv_dtype]
            return torch.cat(
                [torch.frombuffer(bytearray(p), dtype=dtype).view(shape) for p in payloads], dim=1
            )
        except Exception:  # a lookup is an optimisation: the request recomputes
            log.exception("kv tier lookup failed")
            return None


class KVTiers:
    """The tiers below the pool as the scheduler and the core see them (scheduling/scheduler.py
    `BelowPool`): writes as requests leave, lookups as they arrive, the prefill speed for the cost model."""

    def __init__(self, tiers: TierSet, writes: SegmentWrites, reads: SegmentReads) -> None:
        self.tiers = tiers
        self.writes = writes
        self.reads = reads

    def look(self, request: Request, num_cached_tokens: int) -> None:
        self.reads.look(request, num_cached_tokens)

    def is_looking(self, request: Request) -> bool:
        return self.reads.is_looking(request)

    def found(self, request: Request, num_cached_tokens: int) -> _Fetched | None:
        return self.reads.found(request, num_cached_tokens)

    def on_finish(self, request: Request, reason: FinishReason) -> None:
        self.reads.forget(request)
        if reason is not FinishReason.ABORT:
            self.writes.on_finish(request)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.tiers.costs.observe_step(num_tokens, seconds)

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        self.reads.on_ready = wake

    def wait_lookups(self, timeout_s: float) -> None:
        self.reads.wait_lookups(timeout_s)

    def report(self) -> TierReport:
        return self.tiers.report()

    def take_events(self) -> list[TierEvent]:
        return self.tiers.take_events()

    def close(self, timeout: float = 5.0) -> None:
        self.reads.close()
        self.writes.close(timeout)


def _tails(request: Request, size: int, block_size: int) -> list[int]:
    """The ends of the tails: each cache breakpoint that falls inside a segment, rounded down to a block,
    and never past the block before the prompt's last token (which a lookup never reads: a breakpoint at
    the prompt's end is kept up to there). The segment's part up to it is kept on its own, under the key of
    its last block (a key names its start too: the segment boundary below its end)."""
    limit = (request.num_prompt_tokens - 1) // block_size * block_size
    ends = {min(point.num_tokens // block_size * block_size, limit) for point in request.cache_breakpoints}
    return sorted(end for end in ends if end % size)


def _check_tail(
    namespace: Namespace, cache_salt: bytes, start: int, hashes: list[bytes], _: int, value: bytes
) -> bytes:
    return decode(value, namespace, cache_salt, start, hashes)


def _segment_ending(end: int, size: int, block_size: int) -> slice:
    """The block indices of the segment (whole, or a tail) ending at token `end`: it starts at the segment
    boundary below `end`."""
    return slice((end - 1) // size * size // block_size, end // block_size)


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
    """The configured tiers, fastest first: the worker's memory, the node's disk, then the shared Redis."""
    tiers: list[Tier] = []
    if config.host_capacity_mb > 0:
        tiers.append(HostTier(config.host_capacity_mb * 2**20))
    if config.disk_path is not None:
        tiers.append(DiskTier(Path(config.disk_path), config.disk_capacity_mb * 2**20))
    if config.shared_url is not None:
        from services.kvcache.redis_tier import RedisTier  # redis only where a shared tier is configured

        timeout_s = config.timeout_ms / 1000
        password = environ.get(KV_TIERS_PASSWORD_ENV)
        tenant_cap = config.tenant_capacity_mb * 2**20
        tiers.append(RedisTier.from_url(config.shared_url, config.ttl_s, timeout_s, password, tenant_cap))
    return TierSet(tiers)


def build_kv_tiers(
    config: KvTiersConfig,
    namespace: Namespace,
    read_kv: ReadKV,
    write_kv: WriteKV,
    device: torch.device,
    environ: dict[str, str],
) -> KVTiers:
    """The configured tiers with their writer and reader, for `EngineCore.use_tiers`."""
    tiers = build_tiers(config, environ)
    writer = SegmentWriter(tiers, bytes_per_s=config.write_mb_per_s * 1e6, refresh_s=config.ttl_s / 2)
    writes = SegmentWrites(
        namespace, config.segment_tokens, writer, read_kv, config.write_through == "always", config.ttl_s
    )
    reads = SegmentReads(
        namespace, config.segment_tokens, tiers, write_kv, config.fetch_deadline_ms / 1000, device
    )
    return KVTiers(tiers, writes, reads)
