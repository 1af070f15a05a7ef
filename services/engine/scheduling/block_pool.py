"""The KV block pool with automatic prefix caching. Pure bookkeeping: no tensors.

A block is in exactly one of three states:
  active  ref_cnt > 0, held by one or more requests;
  cached  ref_cnt == 0 with a hash: evictable, reusable on a prefix hit;
  free    ref_cnt == 0 without a hash.

Free and cached blocks sit in one LRU queue. Freed blocks without a hash go to its front (reused first);
freed blocks with a hash go to its back, so the least recently used cached block is evicted first.
A hit is verified against the block's token IDs, so a hash collision can never return wrong KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

# In a request's block_ids: a block freed while it runs because it fell out of every layer's sliding
# window (kv_manager.py). Attention reads it as block 0 and masks it out.
NO_BLOCK = -1


@dataclass
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class KVEvent:
    """A change in what the cache holds, for routers that index replicas by prefix."""

    kind: str  # "stored" or "removed"
    block_hash: bytes


@dataclass
class BlockPoolStats:
    num_total: int
    num_active: int
    num_cached: int
    num_free: int


@dataclass
class BlockPool:
    num_blocks: int
    enable_caching: bool = True
    record_events: bool = False
    blocks: list[Block] = field(init=False)
    _queue: OrderedDict[int, None] = field(init=False)  # free + cached blocks, LRU first
    _cached: dict[bytes, int] = field(init=False)  # block hash -> block ID
    events: list[KVEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._queue = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached = {}

    def enable_events(self) -> None:
        """Record a KVEvent for every hash stored or evicted from now on (read them with `take_events`)."""
        self.record_events = True

    @property
    def num_available(self) -> int:
        """Blocks that can be handed out now (free plus evictable cached)."""
        return len(self._queue)

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Take `num_blocks` blocks from the LRU end, evicting cached ones; None if not enough."""
        if num_blocks > len(self._queue):
            return None
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._queue.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on blocks found by `lookup`."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; tail blocks first so they are evicted first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._queue[block_id] = None
                if block.block_hash is None:
                    self._queue.move_to_end(block_id, last=False)

    def lookup(self, block_hashes: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """The longest run of leading blocks already cached, verified token by token."""
        if not self.enable_caching:
            return []
        hits: list[int] = []
        for block_hash, tokens in zip(block_hashes, token_blocks, strict=False):
            block_id = self._cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def commit(self, block_id: int, block_hash: bytes, token_ids: Sequence[int]) -> None:
        """Register a full, computed block under its hash. A hash already cached keeps its block."""
        if not self.enable_caching or block_hash in self._cached:
            return
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id
        if self.record_events:
            self.events.append(KVEvent("stored", block_hash))

    def cached_hashes(self) -> list[bytes]:
        """Every block hash the cache holds now (active or evictable): a snapshot for KV events."""
        return list(self._cached)

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, oldest first."""
        events, self.events = self.events, []
        return events

    def _evict(self, block: Block) -> None:
        if block.block_hash is None:
            return
        del self._cached[block.block_hash]
        if self.record_events:
            self.events.append(KVEvent("removed", block.block_hash))
        block.block_hash = None
        block.token_ids = ()

    def reset_cache(self) -> bool:
        """Drop every cached prefix; only possible when no block is active."""
        if any(block.ref_cnt for block in self.blocks):
            return False
        for block in self.blocks:
            self._evict(block)
        return True

    def stats(self) -> BlockPoolStats:
        num_cached = sum(1 for i in self._queue if self.blocks[i].block_hash is not None)
        num_active = self.num_blocks - len(self._queue)
        return BlockPoolStats(
            num_total=self.num_blocks,
            num_active=num_active,
            num_cached=num_cached,
            num_free=len(self._queue) - num_cached,
        )

    def check_invariants(self, expected_refs: dict[int, int]) -> None:
        """Raise if ref counts differ from what the requests hold, or a block is free and in use."""
        for block in self.blocks:
            want = expected_refs.get(block.block_id, 0)
            if block.ref_cnt != want:
                raise RuntimeError(f"block {block.block_id}: ref_cnt {block.ref_cnt}, requests hold {want}")
            if (block.ref_cnt == 0) != (block.block_id in self._queue):
                raise RuntimeError(f"block {block.block_id} is both free and in use")
        for block_hash, block_id in self._cached.items():
            if self.blocks[block_id].block_hash != block_hash:
                raise RuntimeError(f"cache map points block {block_id} at a stale hash")
