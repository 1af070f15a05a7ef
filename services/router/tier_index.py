"""What the tiers below the replicas' pools hold, as the router sees it from their KV events.

A worker reports each segment it writes to a tier, and each one it knows was dropped (evicted for room,
refused as corrupt), as the hash of the segment's last block with the block index it starts at
(KVEventBatch.tier_stored / tier_removed). A segment in the shared tier is every replica's: any of them
fetches it at admission. One in a replica's host or disk tier is that replica's own (a disk tier shared by a
node's workers counts only for the writer: the router does not know the nodes). The shared tier expires
values by itself, so an entry there lives for the lifetime the write asked for, extended by later writes;
entries go with an explicit removal too.

`below_blocks` follows what a worker's lookup does (engine/kv_tiers.py SegmentReads): from the segment
boundary at or below the pool's hit, whole segments while each is found, then the longest tail in the
segment where they stop that ends at one of the request's own cache breakpoints, in the tiers the replica
reports up. The router counts those blocks as one fetch away: cheaper than recomputing, dearer than the
pool (policy.CostModel). The index is bounded (MAX_SHARED, MAX_OWN: least recently written out first).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.proto_gen.kvrelay.v1 import worker_pb2 as pb

SHARED = "shared"
MAX_SHARED = 262_144  # shared segments indexed, least recently written out first (about 50 MB)
MAX_OWN = 65_536  # per replica
EXPIRE_BATCH = 1024  # expired entries dropped per `expire` call, oldest written first


@dataclass(frozen=True)
class BelowSegment:
    first_block: int  # the prompt block it starts at: a lookup reaches it from there only
    num_blocks: int
    expires_at: float | None  # on the index's clock; None: until a removal says otherwise


class TierIndex:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.shared: OrderedDict[bytes, BelowSegment] = OrderedDict()  # least recently written first
        # replica name -> its host and disk segments, by (tier, last block hash)
        self.own: dict[str, OrderedDict[tuple[str, bytes], BelowSegment]] = {}
        self.segment_blocks = 0  # blocks per whole segment, as reported (the longest segment seen)

    def apply(
        self, replica: str, stored: Iterable[pb.TierSegment], removed: Iterable[pb.TierSegment]
    ) -> None:
        """One KV event batch's tier changes from `replica` (one event per segment and tier: the worker
        keeps only each one's last)."""
        own = self.own.setdefault(replica, OrderedDict())
        for segment in removed:
            if segment.tier == SHARED:
                self.shared.pop(segment.block_hash, None)
            else:
                own.pop((segment.tier, segment.block_hash), None)
        now = self.clock()
        for segment in stored:
            self.segment_blocks = max(self.segment_blocks, segment.num_blocks)
            if segment.tier == SHARED:
                known = self.shared.pop(segment.block_hash, None)
                expires_at = now + segment.ttl_s
                if known is not None and known.expires_at is not None:
                    expires_at = max(expires_at, known.expires_at)  # lifetimes only grow
                entry = BelowSegment(segment.first_block, segment.num_blocks, expires_at)
                _put_bounded(self.shared, segment.block_hash, entry, MAX_SHARED)
            else:
                entry = BelowSegment(segment.first_block, segment.num_blocks, None)
                own.pop((segment.tier, segment.block_hash), None)
                _put_bounded(own, (segment.tier, segment.block_hash), entry, MAX_OWN)

    def forget(self, replica: str) -> None:
        """The replica's own tiers are unknown again (its event stream broke); the shared tier stays."""
        self.own.pop(replica, None)

    def expire(self) -> None:
        """Drop shared entries past their lifetime (the Redis has dropped them), a batch at a time from the
        least recently written; `below_blocks` skips any expired one it meets anyway."""
        now = self.clock()
        for _ in range(EXPIRE_BATCH):
            oldest = next(iter(self.shared.items()), None)
            if oldest is None or oldest[1].expires_at is None or oldest[1].expires_at > now:
                return
            del self.shared[oldest[0]]

    def below_blocks(
        self,
        replica: str,
        hashes: Sequence[bytes],
        num_cached_blocks: int,
        tiers_up: Collection[str],
        tail_ends: Collection[int] = (),
    ) -> int:
        """The prompt block a lookup on `replica` would reach below its pool's hit of `num_cached_blocks`
        (`num_cached_blocks` itself when nothing is found), counting only the tiers it reports up
        (`tiers_up`), and tails only where the request asks for them again (`tail_ends`: block indices of
        its cache breakpoints, as the worker looks them up)."""
        size = self.segment_blocks
        own: Mapping[tuple[str, bytes], BelowSegment] = self.own.get(replica, {})
        if not size or not tiers_up or (not self.shared and not own):
            return num_cached_blocks
        now = self.clock()
        shared: Mapping[bytes, BelowSegment] = self.shared if SHARED in tiers_up else {}
        mine = [tier for tier in tiers_up if tier != SHARED]

        def found(end: int, start: int) -> bool:
            block_hash = hashes[end - 1]
            segments = [shared.get(block_hash), *(own.get((tier, block_hash)) for tier in mine)]
            return any(
                s is not None and s.first_block == start and (s.expires_at is None or s.expires_at > now)
                for s in segments
            )

        start = num_cached_blocks - num_cached_blocks % size
        while start + size <= len(hashes) and found(start + size, start):
            start += size
        tails = sorted(
            (end for end in tail_ends if start < end < start + size and end <= len(hashes)), reverse=True
        )
        for end in tails:  # the longest first, as the worker tries them
            if found(end, start):
                start = end
                break
        return max(start, num_cached_blocks)


def _put_bounded(entries: OrderedDict[Any, BelowSegment], key: Any, entry: BelowSegment, bound: int) -> None:
    entries[key] = entry
    while len(entries) > bound:
        entries.popitem(last=False)
