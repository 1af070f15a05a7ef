"""The engine core: a plain synchronous loop. Token IDs and sampling parameters in, token IDs out.

step(): schedule -> run the model -> append sampled tokens, check stops, free finished requests.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from services.common.block_hash import BlockHasher, root_hash
from services.common.config import EngineConfig, KvrelayConfig
from services.common.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    TokenOutOfRangeError,
)
from services.common.sampling import SamplingParams
from services.engine.block_pool import BlockPool, BlockPoolStats
from services.engine.kv_cache import KVCacheSpec, allocate_kv_caches, check_host_memory, plan_num_blocks
from services.engine.kv_manager import KVCacheManager, PrefixCacheStats
from services.engine.loader import LoadedModel, load_model
from services.engine.request import FinishReason, Request, TokenLogprob
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one sequence: a new token, and whether the sequence ended."""

    request_id: str
    index: int  # which of the request's n samples
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks: BlockPoolStats
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_steps: int


class EngineCore:
    def __init__(self, loaded: LoadedModel, engine: EngineConfig, batch_size_limit: int) -> None:
        cfg = loaded.config
        self.model_config = cfg
        self.manifest = loaded.manifest
        self.block_size = engine.block_size
        self.max_model_len = min(
            engine.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        spec = KVCacheSpec.for_model(cfg, engine.block_size, loaded.model.kv_dtype)
        self.num_blocks = plan_num_blocks(spec, engine.kv_cache_memory_mb, self.max_model_len)
        check_host_memory(loaded.weight_bytes, self.num_blocks * spec.bytes_per_block)
        self.pool = BlockPool(self.num_blocks, enable_caching=engine.enable_prefix_caching)
        self.prefix_stats = PrefixCacheStats()
        self.kv = KVCacheManager(self.pool, engine.block_size, self.prefix_stats)
        self.scheduler = Scheduler(self.kv, engine.max_num_batched_tokens, batch_size_limit)
        caches = allocate_kv_caches(spec, self.num_blocks, torch.device("cpu"))
        self.runner = ModelRunner(loaded.model, caches, engine.block_size, cfg.vocab_size, engine.seed)
        self.root_hash = root_hash(loaded.manifest.model_fingerprint)
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.num_steps = 0

    @classmethod
    def from_config(cls, config: KvrelayConfig) -> EngineCore:
        if config.engine.num_threads:
            torch.set_num_threads(config.engine.num_threads)
        loaded = load_model(config.model.path, config.model.dtype)
        return cls(loaded, config.engine, config.limits.batch_size_limit)

    # -- requests ---------------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise a typed InvalidRequestError for bad input. Allocates nothing."""
        if not prompt_token_ids:
            raise EmptyPromptError()
        vocab = self.model_config.vocab_size
        for token_id in prompt_token_ids:
            if not isinstance(token_id, int) or isinstance(token_id, bool) or not 0 <= token_id < vocab:
                raise TokenOutOfRangeError(token_id, vocab)
        params.validate(vocab)
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(len(prompt_token_ids), params.max_tokens, self.max_model_len)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        extra_key: bytes = b"",
        arrival_time: float | None = None,
    ) -> list[str]:
        """Queue a request (n sequences for n > 1). Returns the internal sequence IDs."""
        if not request_id:
            raise InvalidRequestError("request_id must not be empty", param="request_id")
        self.validate(prompt_token_ids, params)
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if any(s in self.scheduler.requests for s in seq_ids):
            raise DuplicateRequestError(f"request {request_id!r} is already running")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        for i, seq_id in enumerate(seq_ids):
            seq_params = (
                params if params.seed is None or i == 0 else replace(params, seed=(params.seed + i) % 2**63)
            )
            self.scheduler.add(
                Request(
                    request_id=seq_id,
                    prompt_token_ids=list(prompt_token_ids),
                    params=seq_params,
                    block_hasher=BlockHasher(self.root_hash, self.block_size, extra_key),
                    eos_token_ids=self.eos_token_ids,
                    priority=priority,
                    arrival_time=arrival,
                    group_leader_id=seq_ids[0] if i > 0 else None,
                    max_model_len=self.max_model_len,
                )
            )
        return seq_ids

    def abort(self, seq_ids: Sequence[str]) -> int:
        """Abort sequences wherever they are; every block returns to the pool. Returns how many."""
        num_aborted = 0
        for seq_id in seq_ids:
            request = self.scheduler.requests.get(seq_id)
            if request is not None:
                self.scheduler.finish(request, FinishReason.ABORT)
                num_aborted += 1
        return num_aborted

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step.is_empty:
            return []
        result = self.runner.execute(step)
        self.num_steps += 1
        updates = self.scheduler.update(step, result.sampled)
        return [self._output(u.request, u.token, u.finish_reason) for u in updates]

    def _output(self, request: Request, sampled: TokenLogprob, reason: FinishReason | None) -> RequestOutput:
        base_id, _, index = request.request_id.partition("#")
        return RequestOutput(
            request_id=base_id,
            index=int(index) if index else 0,
            new_token_ids=[sampled.token_id],
            logprobs=[sampled] if request.params.logprobs is not None else None,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks=self.pool.stats(),
            prefix_cache_queries=self.prefix_stats.num_queries,
            prefix_cache_hits=self.prefix_stats.num_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
        )

    def check_invariants(self) -> None:
        """Raise if any block's references disagree with what the live requests hold."""
        self.pool.check_invariants(self.scheduler.held_block_refs())
