"""CUDA graphs for decode steps: one captured forward per batch-size bucket over static, padded buffers.

A decode step of n rows runs the graph of the smallest bucket b >= n: its inputs are copied into the
bucket's static buffers (token IDs, positions, slot mapping, block tables, context lengths), rows n..b-1
are padding (slot -1, so the KV store skips them; context length 0, so attention reads nothing and
returns 0), and the logits of rows 0..n-1 come out. Sampling stays outside the graph. Buckets are
1, 2, 4, 8, then every 16 up to the step's row cap; graphs are captured largest first into one shared
memory pool. Prefill and mixed steps, and steps with more rows than the largest bucket, run eagerly.

Only an attention backend whose launches depend on nothing but the static buffers and the bucket can be
captured (`graph_safe`: the Triton kernels; the torch-native path builds its gathers from host lists).

On a CPU there is nothing to capture: "capture" keeps the bucket's forward as a callable and "replay"
calls it over the same static buffers into the same shared logits buffer, so buckets, padding and the
copies in and out run in CI, where a dispatch mode also checks that a replay syncs nothing to the host,
repeats the same operations and allocates nothing that outlives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.engine.layers.attention_backend import PagedAttention
from services.engine.layers.attention_metadata import AttentionMetadata, RowSpec
from services.engine.model_config import ModelConfig
from services.engine.models.registry import CausalLM
from services.engine.ops.triton.dispatch import NUM_SEGMENTS

log = logging.getLogger(__name__)


GRAPH_MARGIN_BYTES = 64 << 20


def estimate_graph_bytes(config: ModelConfig, max_rows: int, max_blocks: int, dtype: torch.dtype) -> int:
    """What the captured graphs will hold, set aside in the KV plan: they are captured after the KV cache
    is allocated, so the plan cannot measure them. The static buffers, the logits buffer every bucket
    shares, and the largest bucket's activations (smaller buckets reuse the one pool), twice over for the
    pool's fragmentation, plus a margin. `DecodeGraphs.capture` logs the real figure beside this one."""
    elem = torch.empty((), dtype=dtype).element_size()
    static = max_rows * (8 * 4 + 4 * 2) + max_rows * max_blocks * 8  # 4 int64 and 2 int32 vectors; tables
    logits = max_rows * config.vocab_size * 4
    q_size = config.num_heads * config.head_dim
    width = 4 * config.hidden_size + 2 * q_size + 3 * config.intermediate_size  # per row, one layer
    split_kv = max_rows * config.num_heads * NUM_SEGMENTS * (config.head_dim + 2) * 4  # fp32 partials
    return static + logits + 2 * (max_rows * width * elem + split_kv) + GRAPH_MARGIN_BYTES


def decode_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, ... (every 16 from 16 on), ending at `max_rows` itself."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_rows] + list(range(16, max_rows, 16))
    return [*buckets, max_rows]


@dataclass
class _Static:
    """One set of buffers for the largest bucket; each bucket uses their leading rows."""

    token_ids: torch.Tensor  # [max_rows] int64
    positions: torch.Tensor  # [max_rows] int64
    slot_mapping: torch.Tensor  # [max_rows] int64, -1 on padding
    block_tables: torch.Tensor  # [max_rows, max_blocks] int64
    seq_lens: torch.Tensor  # [max_rows] int32, 0 on padding
    query_start: torch.Tensor  # [max_rows + 1] int32: row i's token is token i
    rows: torch.Tensor  # [max_rows] int64 arange: each token's row, and the rows whose logits are taken


class DecodeGraphs:
    """Captured decode forwards by bucket, for one model over one set of KV caches."""

    def __init__(
        self,
        model: CausalLM,
        paged: PagedAttention,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_rows: int,
        max_blocks: int,
    ) -> None:
        if not paged.graph_safe:
            raise ValueError(f"{paged.name} attention cannot be captured in a graph")
        self.model = model
        self.paged = paged
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = kv_caches[0].device
        self.buckets = decode_buckets(max_rows)
        self.max_blocks = max_blocks
        self.static = _static_buffers(max_rows, max_blocks, self.device)
        self._replays: dict[int, Callable[[], torch.Tensor]] = {}
        self._eager: dict[int, Callable[[], torch.Tensor]] = {}  # the same forwards, not captured
        self._logits: torch.Tensor | None = None  # [max_rows, vocab]: every bucket's graph writes here
        self.capture_seconds = 0.0
        self.graph_bytes = 0
        self.num_replays: dict[int, int] = dict.fromkeys(self.buckets, 0)

    @property
    def max_rows(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_rows: int) -> int | None:
        return next((b for b in self.buckets if b >= num_rows), None)

    def capture(self) -> None:
        """Capture every bucket, largest first, into one memory pool; log the time and the memory."""
        started = time.perf_counter()
        on_gpu = self.device.type == "cuda"
        if on_gpu:  # capture empties the allocator's cache: empty it first, so the count is the graphs'
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device) if on_gpu else 0
        pool = torch.cuda.graph_pool_handle() if on_gpu else None
        for bucket in sorted(self.buckets, reverse=True):
            self._replays[bucket] = self._capture_one(bucket, pool)
        self.capture_seconds = time.perf_counter() - started
        self.graph_bytes = (torch.cuda.memory_reserved(self.device) - before) if on_gpu else 0
        log.info(
            "decode graphs captured",
            extra={"buckets": len(self.buckets), "max_rows": self.max_rows,
                   "seconds": round(self.capture_seconds, 2), "graph_bytes": self.graph_bytes},
        )  # fmt: skip

    def run(self, token_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The logits [n, vocab] of a decode step of n rows (token_ids and `meta` built as for an eager
        forward, on the device), through the smallest bucket's graph."""
        bucket = self.load(token_ids, meta)
        return self.replay(bucket)[: meta.num_decode_tokens]

    def load(self, token_ids: torch.Tensor, meta: AttentionMetadata) -> int:
        """Copy a decode step's inputs into the static buffers, padding to its bucket; returns the bucket."""
        n = meta.num_decode_tokens
        bucket = self.bucket_for(n)
        if bucket is None or meta.prefill_rows or bucket not in self._replays:
            raise ValueError(f"no decode graph for a step of {n} decode rows")
        s = self.static
        s.token_ids[:n].copy_(token_ids)
        s.positions[:n].copy_(meta.positions)
        s.slot_mapping[:n].copy_(meta.slot_mapping)
        s.slot_mapping[n:bucket].fill_(-1)
        width = meta.block_tables.shape[1]
        s.block_tables[:n, :width].copy_(meta.block_tables)
        s.seq_lens[:n].copy_(s.positions[:n] + 1)
        s.seq_lens[n:bucket].fill_(0)
        return bucket

    def replay(self, bucket: int) -> torch.Tensor:
        """The bucket's graph over what the static buffers hold: logits [bucket, vocab]."""
        self.num_replays[bucket] += 1
        return self._replays[bucket]()

    def eager(self, bucket: int) -> torch.Tensor:
        """The bucket's forward run eagerly over the static buffers: what a replay must equal bit for bit."""
        return self._eager[bucket]()

    def _static_meta(self, bucket: int) -> AttentionMetadata:
        s = self.static
        meta = AttentionMetadata(
            decode_rows=[RowSpec((), 0, 1)] * bucket,  # only their number is read on this path
            prefill_rows=[],
            block_size=self.block_size,
            slot_mapping=s.slot_mapping[:bucket],
            positions=s.positions[:bucket],
            token_rows=s.rows[:bucket],
            block_tables=s.block_tables[:bucket],
            max_context_len=self.max_blocks * self.block_size,
            device=self.device,
        )
        self.paged.prepare_static(meta, s.query_start[: bucket + 1], s.seq_lens[:bucket])
        return meta

    def _capture_one(self, bucket: int, pool: Any) -> Callable[[], torch.Tensor]:
        meta = self._static_meta(bucket)
        s = self.static
        model, caches = self.model, self.kv_caches
        tokens, indices = s.token_ids[:bucket], s.rows[:bucket]

        def forward() -> torch.Tensor:  # locals only: a closure over `self` would keep the caches alive
            return model.forward(tokens, caches, meta, indices)

        self._eager[bucket] = forward
        s.seq_lens[:bucket].fill_(0)  # warm-up and capture read nothing and write nothing
        s.slot_mapping[:bucket].fill_(-1)
        if self.device.type != "cuda":  # the same shared output buffer, the forward called as it is
            if self._logits is None:
                warm = forward()
                self._logits = torch.empty(self.max_rows, *warm.shape[1:], dtype=warm.dtype)
            shared = self._logits[:bucket]

            def call() -> torch.Tensor:
                return shared.copy_(forward())

            return call
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # kernels compiled and autotuned outside the capture
                warm = forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._logits is None:  # one output buffer for every bucket, outside the pool
            self._logits = torch.empty(self.max_rows, *warm.shape[1:], dtype=warm.dtype, device=self.device)
        logits = self._logits[:bucket]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            logits.copy_(forward())  # the forward's own output returns to the pool for the next bucket

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay


def _static_buffers(max_rows: int, max_blocks: int, device: torch.device) -> _Static:
    def longs(*shape: int) -> torch.Tensor:
        return torch.zeros(shape, dtype=torch.long, device=device)

    return _Static(
        token_ids=longs(max_rows),
        positions=longs(max_rows),
        slot_mapping=torch.full((max_rows,), -1, dtype=torch.long, device=device),
        block_tables=longs(max_rows, max_blocks),
        seq_lens=torch.zeros(max_rows, dtype=torch.int32, device=device),
        query_start=torch.arange(max_rows + 1, dtype=torch.int32, device=device),
        rows=torch.arange(max_rows, device=device),
    )
