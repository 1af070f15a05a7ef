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
from services.engine.request import FinishReason, Request, RequestStatus, TokenLogprob
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler


class KVTransferError(InvalidRequestError):
    """Received KV that does not fit the reservation it is meant for (wrong start or token count)."""


@dataclass(frozen=True)
class KVExport:
    """The KV of prompt positions start_token.. of one request, every layer: what a prefill replica ships."""

    start_token: int
    kv: torch.Tensor  # [num_layers, num_tokens, 2, num_kv_heads, head_dim]


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
    kv: KVExport | None = None  # prefill replica: the request stops here and its KV goes to decode

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.kv is not None


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks: BlockPoolStats
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    num_preemptions: int
    num_steps: int
    num_aborted: int = 0  # requests an abort took out while still live (cancel, deadline, shutdown)
    num_generated_tokens: int = 0  # tokens sampled here, every request and sample together


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
        self.kv = KVCacheManager(self.pool, engine.block_size, self.prefix_stats, window=cfg.kv_window)
        self.scheduler = Scheduler(self.kv, engine.max_num_batched_tokens, batch_size_limit)
        caches = allocate_kv_caches(spec, self.num_blocks, torch.device("cpu"))
        self.runner = ModelRunner(loaded.model, caches, engine.block_size, cfg.vocab_size, engine.seed)
        self.root_hash = root_hash(loaded.manifest.model_fingerprint)
        self.eos_token_ids = frozenset(cfg.eos_token_ids)
        self.num_steps = 0
        self.num_aborted = 0

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
        export_kv_from: int | None = None,
    ) -> list[str]:
        """Queue a request (n sequences for n > 1). Returns the internal sequence IDs.

        With `export_kv_from` (a prefill replica), the request stops after its first token unless that
        token ends it, and its output carries the KV of prompt positions export_kv_from.. ."""
        if not request_id:
            raise InvalidRequestError("request_id must not be empty", param="request_id")
        self.validate(prompt_token_ids, params)
        if export_kv_from is not None and (params.n != 1 or not 0 <= export_kv_from < len(prompt_token_ids)):
            raise InvalidRequestError("a remote prefill takes n=1 and a skip inside the prompt", param="n")
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
                    export_kv_from=export_kv_from,
                )
            )
        return seq_ids

    def reserve_remote(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        extra_key: bytes = b"",
    ) -> int | None:
        """Decode replica: hold blocks for a request whose prompt KV a prefill replica will send.
        Returns how many leading prompt tokens are already cached here (the prefill replica skips
        sending them), or None when the pool has no room (the caller computes the prompt here)."""
        if params.n != 1:
            raise InvalidRequestError("a remote prefill takes n=1", param="n")
        self.add_request(request_id, prompt_token_ids, params, priority=priority, extra_key=extra_key)
        request = self.scheduler.requests[request_id]
        self.scheduler.waiting.remove(request)
        if not self.scheduler.reserve(request):
            self.scheduler.waiting.append(request)
            self.scheduler.finish(request, FinishReason.ABORT)
            return None
        return request.num_computed_tokens

    def install_remote(self, request_id: str, first: TokenLogprob, export: KVExport) -> None:
        """Write received prompt KV into the reserved blocks and start decoding after `first`."""
        request = self._reserved(request_id)
        num_tokens = export.kv.shape[1]
        if export.start_token != request.num_computed_tokens or (
            export.start_token + num_tokens != request.num_prompt_tokens
        ):
            raise KVTransferError(
                f"KV for positions {export.start_token}..{export.start_token + num_tokens} does not fit "
                f"a reservation of {request.num_computed_tokens}..{request.num_prompt_tokens}"
            )
        self.runner.write_kv(request.block_ids, export.start_token, export.kv)
        self.scheduler.start_remote(request)
        self._append_first(request, first)

    def resume_local(self, request_id: str, first: TokenLogprob | None) -> None:
        """The remote prefill failed: compute the prompt (and `first`, if it went out already) here."""
        request = self._reserved(request_id)
        if first is not None:
            self._append_first(request, first)
        self.scheduler.requeue(request)

    def end_reserved(self, request_id: str, reason: FinishReason) -> None:
        """The prefill replica's first token already ended the request: free its reservation. Not an
        abort, so `num_aborted` does not count it."""
        request = self.scheduler.requests.get(request_id)
        if request is not None and request.status is RequestStatus.WAITING_FOR_KV:
            self.scheduler.finish(request, reason)

    def _reserved(self, request_id: str) -> Request:
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status is not RequestStatus.WAITING_FOR_KV:
            raise KVTransferError(f"request {request_id!r} holds no KV reservation")
        return request

    @staticmethod
    def _append_first(request: Request, first: TokenLogprob) -> None:
        request.append_token(first.token_id)
        if request.params.logprobs is not None:
            request.logprobs.append(first)

    def abort(self, seq_ids: Sequence[str]) -> int:
        """Abort sequences wherever they are; every block returns to the pool. Returns how many.
        `num_aborted` counts the requests (all n samples as one) that still had a live sequence."""
        removed = []
        for seq_id in seq_ids:
            request = self.scheduler.requests.get(seq_id)
            if request is not None:
                self.scheduler.finish(request, FinishReason.ABORT)
                removed.append(seq_id)
        self.num_aborted += len({seq_id.partition("#")[0] for seq_id in removed})
        return len(removed)

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

    def _export(self, request: Request) -> KVExport:
        """Copy out a prefill-only request's prompt KV, then finish it (its blocks stay cached here)."""
        start = request.export_kv_from or 0
        kv = self.runner.read_kv(request.block_ids, start, request.num_prompt_tokens)
        self.scheduler.finish(request, FinishReason.HANDOFF)
        return KVExport(start, kv)

    def _output(self, request: Request, sampled: TokenLogprob, reason: FinishReason | None) -> RequestOutput:
        kv = self._export(request) if request.export_kv_from is not None and reason is None else None
        base_id, _, index = request.request_id.partition("#")
        return RequestOutput(
            request_id=base_id,
            index=int(index) if index else 0,
            new_token_ids=[sampled.token_id],
            logprobs=[sampled] if request.params.logprobs is not None else None,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            kv=kv,
        )

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.requests) - len(self.scheduler.waiting),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks=self.pool.stats(),
            prefix_cache_queries=self.prefix_stats.num_queries,
            prefix_cache_hits=self.prefix_stats.num_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_steps=self.num_steps,
            num_aborted=self.num_aborted,
            num_generated_tokens=self.scheduler.num_generated_tokens,
        )

    def check_invariants(self) -> None:
        """Raise if any block's references disagree with what the live requests hold."""
        self.pool.check_invariants(self.scheduler.held_block_refs())
