"""Per-request KV block bookkeeping over the block pool: prefix hits, slot allocation, commit, free.

Sliding windows: when every layer of the model attends only to its last `window` keys, a block whose
positions all lie before every future query's window is freed while the request runs, and its slot in
`block_ids` becomes NO_BLOCK (attention reads it as block 0 and masks it out). A model with any
global layer (Gemma 3 has one in six) reads the whole context, so nothing is ever freed early there.
Prefix caching stays correct: freed blocks were committed first, so they stay cached, and a prefix hit
still needs every leading block present, so a hit always carries KV for every position.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.scheduling.block_pool import NO_BLOCK, BlockPool
from services.engine.scheduling.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    """Counted in tokens: what lookups asked for, and what they found."""

    num_queries: int = 0
    num_hits: int = 0


@dataclass
class KVCacheManager:
    pool: BlockPool
    block_size: int
    prefix_stats: PrefixCacheStats
    window: int | None = None  # ModelConfig.kv_window: set only when every layer has a sliding window

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Cached blocks for the request's leading full blocks, counted in the prefix stats. The last
        token is always recomputed, so the engine has logits to sample from."""
        hits = self.peek_cached_prefix(request)
        self.prefix_stats.num_queries += request.num_tokens
        self.prefix_stats.num_hits += len(hits) * self.block_size
        return hits

    def peek_cached_prefix(self, request: Request) -> list[int]:
        """The blocks `find_cached_prefix` would return now, uncounted."""
        num_cacheable = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:num_cacheable]
        token_blocks = [
            request.token_ids[i * self.block_size : (i + 1) * self.block_size] for i in range(len(hashes))
        ]
        return self.pool.lookup(hashes, token_blocks)

    def shortfall(self, request: Request, cached_block_ids: list[int], num_new_tokens: int) -> int:
        """How many blocks `admit` would lack for these arguments now (0: it would succeed)."""
        num_cached_tokens = len(cached_block_ids) * self.block_size
        num_needed = cdiv(num_cached_tokens + num_new_tokens, self.block_size) - len(cached_block_ids)
        num_needed += cdiv(len(request.encoder_token_ids), self.block_size)
        num_reclaimable = sum(1 for b in cached_block_ids if self.pool.blocks[b].ref_cnt == 0)
        return max(0, num_needed - (self.pool.num_available - num_reclaimable))

    def freeable(self, requests: list[Request]) -> int:
        """Blocks that releasing `requests` would give back to the pool: those no other request holds."""
        held = [b for r in requests for b in (*r.block_ids, *r.cross_block_ids) if b != NO_BLOCK]
        counts: dict[int, int] = {}
        for b in held:
            counts[b] = counts.get(b, 0) + 1
        return sum(1 for b, n in counts.items() if self.pool.blocks[b].ref_cnt == n)

    def admit(self, request: Request, cached_block_ids: list[int], num_new_tokens: int) -> bool:
        """Give a waiting request its cached prefix plus room for `num_new_tokens`; False if full."""
        num_cached_tokens = len(cached_block_ids) * self.block_size
        num_needed = cdiv(num_cached_tokens + num_new_tokens, self.block_size) - len(cached_block_ids)
        # An encoder-decoder sequence's cross-attention KV: blocks of its own, counted here too.
        num_cross = cdiv(len(request.encoder_token_ids), self.block_size)
        # Cached blocks still in the LRU queue are not available for fresh allocation.
        num_reclaimable = sum(1 for b in cached_block_ids if self.pool.blocks[b].ref_cnt == 0)
        if num_needed + num_cross > self.pool.num_available - num_reclaimable:
            return False
        self.pool.touch(cached_block_ids)
        new_block_ids = self.pool.allocate(num_needed + num_cross)
        if new_block_ids is None:  # cannot happen after the check above; keep the pool consistent
            self.pool.free(cached_block_ids)
            return False
        request.block_ids = cached_block_ids + new_block_ids[:num_needed]
        request.cross_block_ids = new_block_ids[num_needed:]
        request.needs_encoding = num_cross > 0
        request.num_computed_tokens = num_cached_tokens
        request.num_committed_blocks = len(cached_block_ids)
        return True

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of a running request; False if full."""
        num_needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
        num_extra = num_needed - len(request.block_ids)
        if num_extra <= 0:
            return True
        new_block_ids = self.pool.allocate(num_extra)
        if new_block_ids is None:
            return False
        request.block_ids.extend(new_block_ids)
        return True

    def commit(self, request: Request) -> None:
        """Register every full block whose KV is now computed, so later requests can reuse it."""
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        for index in range(request.num_committed_blocks, num_full):
            tokens = request.token_ids[index * self.block_size : (index + 1) * self.block_size]
            self.pool.commit(request.block_ids[index], request.block_hashes[index], tokens)
        request.num_committed_blocks = max(request.num_committed_blocks, num_full)

    def free_out_of_window(self, request: Request) -> None:
        """Free the leading blocks no future query can see: the next query sits at position
        num_computed_tokens and sees keys after num_computed_tokens - window. Only committed blocks go
        (their KV stays cached), and never a prefill replica's, whose prompt KV is still to be shipped."""
        if self.window is None or request.export_kv_from is not None:
            return
        num_unseen = max(request.num_computed_tokens - self.window + 1, 0) // self.block_size
        num_unseen = min(num_unseen, request.num_committed_blocks)
        freed = [b for b in request.block_ids[:num_unseen] if b != NO_BLOCK]
        if freed:
            self.pool.free(freed)
            request.block_ids[:num_unseen] = [NO_BLOCK] * num_unseen

    def release(self, request: Request) -> None:
        """Return every block of the request to the pool. Committed blocks stay cached."""
        self.pool.free([b for b in request.block_ids if b != NO_BLOCK] + request.cross_block_ids)
        request.block_ids = []
        request.cross_block_ids = []
        request.num_committed_blocks = 0
