"""The engine core: a plain synchronous loop. Token IDs and sampling parameters in, token IDs out.

step(): schedule -> run the model -> append sampled tokens, check stops, free finished requests.
With `overlap` (the default on a GPU), a step launches step t+1 before it reads back step t's tokens, so
the host schedules and prepares t+1 while t runs on the device: t+1 takes t's tokens on the device, and
a sequence t ends (a stop token) has computed one token too many, which is dropped. Rows with penalties
or a grammar need their tokens on the host (the penalties count them; the grammar's mask for t+1 follows
t's token), so a step that has them waits for t first. step() returns t's outputs.

Structured output: a request with `params.grammar` gets one matcher per sample when it is added
(grammar_matchers.py; a grammar that does not compile is a GrammarError, a 400); the runner masks those
rows' logits each step, and the sample ends once its grammar is complete (Request.check_stop).

The core is handed its parts (a scheduler over a KV cache manager and block pool, and a `Runner`);
`loading/factory.py` builds them from a model directory (`build_core`); tests put a fake runner in.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import torch

from services.common.block_hash import BlockHasher, request_salt, root_hash
from services.common.engine_input import (
    CacheBreakpoint,
    EngineInput,
    cache_written_tokens,
    check_encoder_input,
    check_request,
)
from services.common.errors import (
    ContextLengthExceededError,
    DuplicateRequestError,
    InvalidRequestError,
)
from services.common.grammar import GrammarError
from services.common.manifest import Manifest
from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams
from services.engine.kv_export import KVExport, KVTransferError
from services.engine.layers.grammar_matchers import GrammarMatchers
from services.engine.model_config import ModelConfig
from services.engine.runner_protocol import PendingStep, Runner
from services.engine.scheduling.block_pool import BlockPoolStats, KVEvent
from services.engine.scheduling.request import Request, RequestStatus
from services.engine.scheduling.scheduler import (
    BelowPool,
    PendingToken,
    Scheduler,
    SchedulerOutput,
    StepUpdate,
)
from services.kvcache.tier_set import TierEvent, TierReport

if TYPE_CHECKING:
    from llguidance import LLMatcher

__all__ = ["EngineCore", "EngineStats", "KVExport", "KVTransferError", "RequestOutput"]


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
    num_cache_written_tokens: tuple[int, ...] = ()  # per cache breakpoint (engine_input.cache_written_tokens)
    # An encoder-decoder sequence's encoder pass (wall-clock ns, start and end), on its first output after
    # it: the worker's encode span.
    encode_times_ns: tuple[int, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.kv is not None


@dataclass(frozen=True)
class _InFlight:
    """A launched step whose tokens are not read back yet."""

    pending: PendingStep
    tokens: list[PendingToken]

    @property
    def needs_tokens_on_host(self) -> bool:
        """A sequence with penalties reads its output tokens on the host when it is sampled next; one with
        a grammar needs its matcher past them before its next mask."""
        return any(t.request.params.has_penalties or t.request.matcher is not None for t in self.tokens)


LOOKUP_WAIT_S = 0.01  # a step that ran nothing waits this long at most for a tier lookup to end


class TiersBelow(BelowPool, Protocol):
    """The KV tiers below the pool as the core drives them (engine/kv_tiers.py KVTiers)."""

    def observe_step(self, num_tokens: int, seconds: float) -> None: ...

    def set_wake(self, wake: Callable[[], None] | None) -> None: ...

    def take_events(self) -> list[TierEvent]: ...

    def wait_lookups(self, timeout_s: float) -> None: ...

    def report(self) -> TierReport: ...

    def close(self) -> None: ...


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
    # Steps by the path the model's layers took (models/llama.py STEP_PATHS); empty for a family with one
    steps_by_path: dict[str, int] = field(default_factory=dict)
    # Encoder-decoder models: sequences and source tokens this engine encoded (a decode replica only what
    # it runs itself: a request split with a prefill replica comes with its encoder output).
    num_encoded_sequences: int = 0
    num_encoded_tokens: int = 0
    waiting_by_priority: dict[int, int] = field(default_factory=dict)  # num_waiting by priority class


@dataclass(frozen=True)
class ServedWeights:
    """What the model is served from, for the worker's info, its metrics and `kvrelay status`."""

    weights: str  # model.weights, auto resolved
    weight_bytes: int  # resident bytes of every copy of the weights held
    small_step_max_tokens: int | None = None  # steps up to this many tokens run the C kernels; None: none
    small_step_source: str = ""  # where that number came from (ops/step_threshold.py)
    numerics: str = "default"  # or deterministic (engine.deterministic: loading/deterministic.py)


class EngineCore:
    """Requests in, one output per sampled token out. Not thread-safe: one thread drives it."""

    def __init__(
        self,
        model_config: ModelConfig,
        manifest: Manifest,
        scheduler: Scheduler,
        runner: Runner,
        *,
        max_model_len: int,
        overlap: bool = False,
        grammars: GrammarMatchers | None = None,
        served: ServedWeights | None = None,
    ) -> None:
        """`scheduler` brings the KV cache manager and block pool it schedules over; `runner` computes
        steps over KV blocks of the same pool and block size. `overlap`: see the module docstring.
        `grammars`: the matchers for the model's tokenizer; None refuses every grammar (GrammarError)."""
        self.model_config = model_config
        self.manifest = manifest
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.pool = scheduler.kv.pool
        self.prefix_stats = scheduler.kv.prefix_stats
        self.runner = runner
        self.block_size = scheduler.kv.block_size
        self.num_blocks = self.pool.num_blocks
        self.max_model_len = max_model_len
        self.root_hash = root_hash(manifest.model_fingerprint)
        self.eos_token_ids = frozenset(model_config.eos_token_ids)
        self.num_steps = 0
        self.num_aborted = 0
        self.overlap = overlap
        self.grammars = grammars
        self.served = served or ServedWeights("safetensors", 0)
        self._in_flight: _InFlight | None = None
        self.tiers: TiersBelow | None = None
        self._stalled = False

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.runner.weight_dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.runner.kv_dtype

    @property
    def device(self) -> torch.device:
        return self.runner.device

    # -- requests ---------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def check(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: bytes = b"",
        cache_breakpoints: Sequence[CacheBreakpoint] = (),
        encoder_token_ids: Sequence[int] = (),
    ) -> EngineInput:
        """The library's one check of a request's values (engine_input.check_request) against this model's
        vocabulary, and of its ID against the requests live here. Allocates nothing. An encoder-decoder
        model takes an encoder input of 1 to max_model_len tokens; a decoder-only one takes none."""
        request = check_request(
            request_id,
            prompt_token_ids,
            params,
            self.vocab_size,
            priority=priority,
            cache_salt=cache_salt,
            cache_breakpoints=cache_breakpoints,
            encoder_token_ids=encoder_token_ids,
        )
        if self.scheduler.live_samples(request_id):
            raise DuplicateRequestError(f"request {request_id!r} is already running")
        return request

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: bytes = b"",
        cache_breakpoints: Sequence[CacheBreakpoint] = (),
        arrival_time: float | None = None,
        export_kv_from: int | None = None,
        encoder_token_ids: Sequence[int] = (),
    ) -> None:
        """Check a request (`check`) and queue it (`add`): the entry for callers that hold raw values."""
        request = self.check(
            request_id,
            prompt_token_ids,
            params,
            priority=priority,
            cache_salt=cache_salt,
            cache_breakpoints=cache_breakpoints,
            encoder_token_ids=encoder_token_ids,
        )
        self.add(request, arrival_time=arrival_time, export_kv_from=export_kv_from)

    def add(
        self, request: EngineInput, *, arrival_time: float | None = None, export_kv_from: int | None = None
    ) -> None:
        """Queue a checked request, whose ID its caller holds (AsyncEngine, `add_request`): n sequences for
        n > 1, samples 0..n-1 of its ID.

        With `export_kv_from` (a prefill replica), the request stops after its first token unless that
        token ends it, and its output carries the KV of prompt positions export_kv_from.. ."""
        for sample in self._new_samples(request, arrival_time, export_kv_from):
            self.scheduler.add(sample)

    def _new_samples(
        self, request: EngineInput, arrival_time: float | None, export_kv_from: int | None
    ) -> list[Request]:
        """The request's n sequences, not yet queued; sample i > 0 is seeded seed + i. Checks what only
        this engine knows: the context length, the encoder input (every entry passes here), and a skip
        inside the prompt."""
        prompt, params = request.prompt_token_ids, request.params
        is_encoder_decoder = self.model_config.is_encoder_decoder
        check_encoder_input(request.encoder_token_ids, is_encoder_decoder, self.max_model_len)
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise ContextLengthExceededError(len(prompt), params.max_tokens, self.max_model_len)
        if export_kv_from is not None and (params.n != 1 or not 0 <= export_kv_from < len(prompt)):
            raise InvalidRequestError("a remote prefill takes n=1 and a skip inside the prompt", param="n")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        matchers = self._matchers(params)
        samples = []
        for index in range(params.n):
            seed = params.seed
            if seed is not None and index > 0:
                sample_params = replace(params, seed=(seed + index) % 2**63)
            else:
                sample_params = params
            samples.append(
                Request(
                    parent_id=request.request_id,
                    sample_index=index,
                    prompt_token_ids=list(prompt),
                    params=sample_params,
                    block_hasher=BlockHasher(
                        self.root_hash,
                        self.block_size,
                        request_salt(request.cache_salt, request.encoder_token_ids),
                    ),
                    eos_token_ids=self.eos_token_ids,
                    priority=request.priority,
                    arrival_time=arrival,
                    max_model_len=self.max_model_len,
                    export_kv_from=export_kv_from,
                    matcher=matchers[index],
                    cache_salt=request.cache_salt,
                    cache_breakpoints=request.cache_breakpoints,
                    encoder_token_ids=list(request.encoder_token_ids),
                )
            )
        return samples

    def _matchers(self, params: SamplingParams) -> list[LLMatcher | None]:
        """One grammar matcher per sample, or Nones when the request has no grammar."""
        if params.grammar is None:
            return [None] * params.n
        if self.grammars is None:
            raise GrammarError("structured output is not available for this model: it has no tokenizer")
        return list(self.grammars.matchers(params.grammar, params.n))

    def reserve_remote(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: bytes = b"",
    ) -> int | None:
        """Check a request (`check`) and `reserve` for it: the entry for callers that hold raw values."""
        return self.reserve(
            self.check(request_id, prompt_token_ids, params, priority=priority, cache_salt=cache_salt)
        )

    def reserve(self, request: EngineInput) -> int | None:
        """Decode replica: hold blocks for a checked request whose prompt KV a prefill replica will send.
        Returns how many leading prompt tokens are already cached here (the prefill replica skips
        sending them), or None when the pool has no room (nothing is held; the caller computes the
        prompt here)."""
        if request.params.n != 1:
            raise InvalidRequestError("a remote prefill takes n=1", param="n")
        [sample] = self._new_samples(request, None, None)
        if not self.scheduler.reserve(sample):
            return None
        return sample.num_computed_tokens

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
        if request.encoder_token_ids:  # the cross KV from the shipped encoder output
            states = export.encoder_states
            expected = (len(request.encoder_token_ids), self.model_config.hidden_size)
            if states is None or tuple(states.shape) != expected:
                got = None if states is None else tuple(states.shape)
                raise KVTransferError(
                    f"encoder states of shape {got} do not fit a source of shape {expected}"
                )
            self.runner.write_cross(request, states)
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
        for request in self.scheduler.live_samples(request_id):
            if request.status is RequestStatus.WAITING_FOR_KV:
                self.scheduler.finish(request, reason)

    def _reserved(self, request_id: str) -> Request:
        reserved = [
            r for r in self.scheduler.live_samples(request_id) if r.status is RequestStatus.WAITING_FOR_KV
        ]
        if not reserved:
            raise KVTransferError(f"request {request_id!r} holds no KV reservation")
        return reserved[0]

    @staticmethod
    def _append_first(request: Request, first: TokenLogprob) -> None:
        """The prefill replica's first token is in: the grammar, if any, moves past it here too."""
        request.append_token(first.token_id)
        if request.params.logprobs is not None:
            request.logprobs.append(first)
        if request.grammar_refused:
            raise KVTransferError(f"the prefill replica's first token {first.token_id} breaks the grammar")

    def abort(self, request_ids: Sequence[str]) -> int:
        """Abort every live sample of these requests, wherever it is; every block returns to the pool.
        Returns how many sequences. `num_aborted` counts the requests that still had a live sample."""
        return sum(len(self.abort_request(request_id)) for request_id in request_ids)

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Abort every live sample of one request, like `abort`; returns an ABORT output (no new tokens)
        for each sample that was live, for a caller that still streams them."""
        samples = self.scheduler.live_samples(request_id)
        for request in samples:
            self.scheduler.finish(request, FinishReason.ABORT)
        if samples:
            self.num_aborted += 1
        return [_ended(r, FinishReason.ABORT) for r in samples]

    def prepare_grammars(self) -> str | None:
        """Build the grammar compiler now (thread-safe), so no request waits for it: a worker calls this
        before it serves. Returns why grammars are refused here, or None when they are ready."""
        if self.grammars is None:
            return "this engine has no tokenizer"
        return None if self.grammars.prepare() else self.grammars.unavailable

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        num_steps = self.num_steps
        try:
            return self._overlapped_step() if self.overlap else self._plain_step()
        finally:
            self._stalled = self.num_steps == num_steps and self._in_flight is None
            if self._stalled and self.tiers is not None:
                self.tiers.wait_lookups(LOOKUP_WAIT_S)

    def is_stalled(self) -> bool:
        """Whether the last `step` had work but could run none of it: its waiting requests cannot be
        admitted yet (tier lookups still running, no KV room) and nothing else runs."""
        return self._stalled

    def _plain_step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step.is_empty:
            return []
        started = time.perf_counter()
        result = self.runner.execute(step)
        self._observe_step(step, time.perf_counter() - started)
        self.num_steps += 1
        return self._outputs(self.scheduler.update(step, result.sampled))

    def _overlapped_step(self) -> list[RequestOutput]:
        """Launch step t+1, then read back step t (the one launched by the previous call)."""
        started = time.perf_counter()
        previous, self._in_flight = self._in_flight, None
        outputs = []
        if previous is not None and previous.needs_tokens_on_host:
            outputs, previous = self._collect(previous), None
        step = self.scheduler.schedule()
        if not step.is_empty:
            pending = self.runner.launch(step)
            self.num_steps += 1
            self._in_flight = _InFlight(pending, self.scheduler.advance(step))
        outputs += self._collect(previous) if previous is not None else []
        if not step.is_empty:  # about one step's time: this call waited for the one before
            self._observe_step(step, time.perf_counter() - started)
        return outputs

    def _observe_step(self, step: SchedulerOutput, seconds: float) -> None:
        if self.tiers is not None:
            self.tiers.observe_step(step.num_batched_tokens, seconds)

    def _collect(self, in_flight: _InFlight) -> list[RequestOutput]:
        sampled = in_flight.pending.collect().sampled
        return self._outputs(self.scheduler.resolve(in_flight.tokens, sampled))

    def _outputs(self, updates: list[StepUpdate]) -> list[RequestOutput]:
        return [self._output(u.request, u.token, u.finish_reason) for u in updates]

    def set_before_forward(self, hook: Callable[[], None] | None) -> None:
        """Call `hook` on the stepping thread right before each forward, once its inputs are built."""
        self.runner.set_before_forward(hook)

    def _export(self, request: Request) -> KVExport:
        """Copy out a prefill-only request's prompt KV, then finish it (its blocks stay cached here)."""
        start = request.export_kv_from or 0
        kv = self.runner.read_kv(request.block_ids, start, request.num_prompt_tokens)
        states, request.encoder_output = request.encoder_output, None
        self.scheduler.finish(request, FinishReason.HANDOFF)
        return KVExport(start, kv, states)

    def _output(self, request: Request, sampled: TokenLogprob, reason: FinishReason | None) -> RequestOutput:
        kv = self._export(request) if request.export_kv_from is not None and reason is None else None
        encoded, request.encode_times_ns = request.encode_times_ns, None
        return RequestOutput(
            request_id=request.parent_id,
            index=request.sample_index,
            new_token_ids=[sampled.token_id],
            logprobs=[sampled] if request.params.logprobs is not None else None,
            finish_reason=reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            kv=kv,
            num_cache_written_tokens=self._written(request),
            encode_times_ns=encoded,
        )

    def _written(self, request: Request) -> tuple[int, ...]:
        return cache_written_tokens(request.cache_breakpoints, request.num_cached_tokens, self.block_size)

    # -- the KV tiers below the pool --------------------------------------------------------------

    def use_tiers(self, tiers: TiersBelow) -> None:
        """Use the KV tiers below the pool (engine/kv_tiers.py): the scheduler looks up each new request
        there and shows them each one that leaves; every step's size and time feed their cost model."""
        self.scheduler.below = tiers
        self.tiers = tiers

    def set_wake(self, wake: Callable[[], None] | None) -> None:
        """Call `wake` (from any thread) when something this engine waits on outside a step is ready: a
        tier lookup that ended. The driver may sleep until then when a step ran nothing."""
        if self.tiers is not None:
            self.tiers.set_wake(wake)

    def close(self) -> None:
        """Let queued tier writes finish (bounded); the engine is not stepped after this."""
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None

    # -- the prefix cache, metrics and checks -----------------------------------------------------

    def enable_kv_events(self) -> None:
        """Record the prefix cache's stored and evicted block hashes from now on (`take_kv_events`)."""
        self.pool.enable_events()

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's changes since the last call, oldest first."""
        return self.pool.take_events()

    def take_tier_events(self) -> list[TierEvent]:
        """Segments written to or dropped from the tiers below the pool since the last call (KV events)."""
        tiers = self.tiers
        return tiers.take_events() if tiers is not None else []

    def cached_block_hashes(self) -> list[bytes]:
        """Every block hash the prefix cache holds now: a snapshot to start KV events from."""
        return self.pool.cached_hashes()

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix; False (and nothing dropped) while any request holds blocks."""
        return self.pool.reset_cache()

    def take_queue_times(self) -> list[float]:
        """Seconds from arrival to first admission of each request admitted since the last call."""
        return self.scheduler.take_queue_times()

    def take_encoder_times(self) -> list[float]:
        """Seconds of each batched encoder pass since the last call (encoder-decoder models)."""
        return self.runner.take_encoder_times()

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
            steps_by_path=dict(getattr(getattr(self.runner, "model", None), "num_steps_by_path", {})),
            num_encoded_sequences=getattr(self.runner, "num_encoded_sequences", 0),
            num_encoded_tokens=getattr(self.runner, "num_encoded_tokens", 0),
            waiting_by_priority=dict(collections.Counter(r.priority for r in list(self.scheduler.waiting))),
        )

    def tier_report(self) -> TierReport | None:
        """The KV tiers' counts now, None without tiers. Thread-safe (the tiers lock their own counts), so
        a reader asks when it reads, and no step pays for it."""
        tiers = self.tiers
        return tiers.report() if tiers is not None else None

    def check_invariants(self) -> None:
        """Raise if any block's references disagree with what the live requests hold."""
        self.pool.check_invariants(self.scheduler.held_block_refs())


def _ended(request: Request, reason: FinishReason) -> RequestOutput:
    """An output that only ends a sample: no new tokens."""
    return RequestOutput(
        request.parent_id, request.sample_index, [], None, reason, request.num_prompt_tokens,
        request.num_cached_tokens,
    )  # fmt: skip
