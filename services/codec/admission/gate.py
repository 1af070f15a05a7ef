"""The one gate every generation passes, whichever protocol it came by (HTTP routes and the public gRPC
API alike), every refusal before any response byte:

    admit    context rules, sampling validation, the structured output   400 (the backend never sees it)
             constraint compiled (off the event loop)
    (entry)  requests per minute, before the body is parsed (HTTP)   429 + Retry-After (charge_request)
    start    quotas (quotas.py; tenant and global, per minute)       429 + Retry-After, nothing held
             a concurrency slot, in the fair queue (fair_queue.py)   503 (529 on /v1/messages) when full
             the backend, waiting for the first token

The `Lease` holds the reservation and the slot; it is closed exactly once, when the generation stream
closes (finished, failed, step timeout, client gone) or when starting fails:

- the backend produced no token (never sent, refused, down, or the client left before the first
  token): the reservation is released whole, request and tokens;
- otherwise it is settled to the tokens really used (prompt + tokens generated so far).

Either way the slot is freed (and passed to the next waiter).

The context rules: a request is refused (400 context_length_exceeded) when its prompt is over
`limits.max_input_tokens`, or when prompt + max_tokens is over the model's context. An explicit
max_tokens over `limits.max_output_tokens` is a 400 too (not clamped). An absent max_tokens becomes
`limits.default_max_output_tokens`, capped by what the context has left. Time spent queued counts against the
request's timeout. The Redis key prefix of the shared quota counters comes from
`KVRELAY_QUOTAS_KEY_PREFIX` (default "{kvrelay-quota}:"), so that deployments and tests sharing one
Redis keep their counters apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

import anyio

from services.codec.admission.fair_queue import FairLimiter, Slot
from services.codec.admission.metrics import LimitsMetrics
from services.codec.admission.quota_redis import DEFAULT_KEY_PREFIX
from services.codec.admission.quota_store import Reservation
from services.codec.admission.quotas import Quotas
from services.codec.backend.info import BackendInfoCache
from services.codec.backend.protocol import BackendInfo, GenerationRequest
from services.codec.errors import PromptTooLongError
from services.codec.generation import GenerationStream, Generator, build_sampling
from services.codec.metrics import RequestStats
from services.common import tracing
from services.common.config import KvrelayConfig, LimitsConfig
from services.common.engine_input import CacheBreakpoint
from services.common.errors import ContextLengthExceededError, InvalidRequestError
from services.common.grammar import Constraint, GrammarSpec

KEY_PREFIX_ENV = "KVRELAY_QUOTAS_KEY_PREFIX"


def resolve_max_tokens(
    limits: LimitsConfig, num_prompt_tokens: int, requested: int | None, max_model_len: int, prompt_param: str
) -> int:
    """The max_tokens to send, or a 400 naming the limit that the request breaks."""
    if requested is not None and requested > limits.max_output_tokens:
        raise InvalidRequestError(
            f"max_tokens ({requested}) is over this server's limit of {limits.max_output_tokens}",
            param="max_tokens",
        )
    if num_prompt_tokens > limits.max_input_tokens:
        raise PromptTooLongError(num_prompt_tokens, limits.max_input_tokens, "input limit", prompt_param)
    if num_prompt_tokens >= max_model_len:
        raise PromptTooLongError(num_prompt_tokens, max_model_len, "model's context", prompt_param)
    if requested is None:
        return min(limits.default_max_output_tokens, max_model_len - num_prompt_tokens)
    if num_prompt_tokens + requested > max_model_len:
        raise ContextLengthExceededError(num_prompt_tokens, requested, max_model_len)
    return requested


def split_encoder_input(
    info: BackendInfo,
    limits: LimitsConfig,
    prompt_token_ids: list[int],
    decoder_prompt_ids: list[int] | None,
    prompt_param: str,
) -> tuple[list[int], tuple[int, ...]]:
    """The decoder's prompt and the encoder's input. For an encoder-decoder model the prompt is the
    encoder's (over the input limit or the model's source length: a 400) and the decoder starts at its
    start token, then `decoder_prompt_ids`; a decoder-only model refuses a decoder prompt."""
    if not info.encoder_decoder:
        if decoder_prompt_ids is not None:
            raise InvalidRequestError(
                "decoder_prompt is for encoder-decoder models; this model is decoder-only", "decoder_prompt"
            )
        return prompt_token_ids, ()
    num_source = len(prompt_token_ids)
    if num_source > limits.max_input_tokens:
        raise PromptTooLongError(num_source, limits.max_input_tokens, "input limit", prompt_param)
    if num_source > info.max_model_len:
        raise PromptTooLongError(num_source, info.max_model_len, "encoder's source length", prompt_param)
    return [info.decoder_start_token_id, *(decoder_prompt_ids or ())], tuple(prompt_token_ids)


class SamplingSource(Protocol):
    """What admission reads from a request body (OpenAI's SamplingFields, Anthropic's MessagesRequest)."""

    def sampling_kwargs(self) -> dict[str, Any]: ...

    def stop_strings(self) -> tuple[str, ...]: ...

    def constraint(self) -> Constraint | None: ...


class GrammarCheck(Protocol):
    async def check_grammar(self, spec: GrammarSpec, param: str) -> None:
        """Compiles the constraint (off the event loop); GrammarError, naming `param`, when it cannot."""
        ...


class Lease:
    """A reservation and a slot, given back by `close` (idempotent, never raises, not cancellable)."""

    def __init__(
        self, quotas: Quotas, reservation: Reservation, slot: Slot, request_charge: Reservation | None = None
    ) -> None:
        self._quotas = quotas
        self.reservation = reservation
        self._slot = slot
        self._request_charge = request_charge
        self._is_closed = False

    @property
    def waited_s(self) -> float | None:
        """Time spent waiting in the fair queue; None when a slot was free at once."""
        return self._slot.waited_s

    async def close(self, tokens_used: int | None) -> None:
        """`tokens_used` None: the backend produced nothing, so everything is released."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            with anyio.CancelScope(shield=True):
                if tokens_used is None:
                    await self._quotas.release(self.reservation)
                    if self._request_charge is not None:
                        await self._quotas.refund(self._request_charge)
                else:
                    await self._quotas.settle(self.reservation, tokens_used)
        finally:
            self._slot.release()


class Gate:
    """The context rules, the quotas and the fair queue of one codec, in front of its generator."""

    def __init__(
        self,
        config: KvrelayConfig,
        info: BackendInfoCache,
        generator: Generator,
        quotas: Quotas,
        limiter: FairLimiter,
        metrics: LimitsMetrics,
        grammars: GrammarCheck | None = None,
    ) -> None:
        self._config = config
        self._grammars = grammars
        self._info = info
        self._generator = generator
        self.quotas = quotas
        self.limiter = limiter
        self.metrics = metrics

    @classmethod
    def from_config(
        cls,
        config: KvrelayConfig,
        info: BackendInfoCache,
        generator: Generator,
        metrics: LimitsMetrics,
        environ: Mapping[str, str],
        grammars: GrammarCheck | None = None,
    ) -> Gate:
        key_prefix = environ.get(KEY_PREFIX_ENV, "").strip() or DEFAULT_KEY_PREFIX
        quotas = Quotas.from_config(config.quotas, metrics, key_prefix=key_prefix)
        limiter = FairLimiter(config.limits.concurrency_limit, config.limits.queue_limit, metrics)
        return cls(config, info, generator, quotas, limiter, metrics, grammars)

    async def charge_request(self, tenant_id: str) -> Reservation:
        """Counts one request against the tenant's and the global requests per minute (a 429 past them)
        before any work is done for it: every HTTP generation route as it opens, before its body is
        parsed, templated or tokenized (`start(..., request_charge=...)` then charges only its tokens),
        and /tokenize, /detokenize and count_tokens. The charge is settled at once: a request refused for
        what it asked (a 400) stays counted, its work was done; one the server could not serve (quota on
        tokens, queue full, backend down) is refunded when its lease is given back."""
        reservation = await self.quotas.reserve(tenant_id, 0, only="requests")
        await self.quotas.settle(reservation, 0)
        return reservation

    async def admit(
        self,
        stats: RequestStats,
        fields: SamplingSource,
        prompt_token_ids: list[int],
        *,
        request_id: str,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_param: str,
        timeout_s: float | None,
        cache_salt: bytes,
        session_key: str = "",
        cache_breakpoints: tuple[CacheBreakpoint, ...] = (),
        decoder_prompt_ids: list[int] | None = None,
        priority: int = 0,
    ) -> GenerationRequest:
        """The request to start, after the context rules and sampling validation. Refusals raise
        InvalidRequestError subclasses. `cache_salt` comes from the authenticated tenant only. For an
        encoder-decoder model `prompt_token_ids` are the encoder's input and `decoder_prompt_ids` what
        the decoder starts from after its start token (split_encoder_input)."""
        info = await self._info.get()
        limits = self._config.limits
        prompt_token_ids, encoder_ids = split_encoder_input(
            info, limits, prompt_token_ids, decoder_prompt_ids, prompt_param
        )
        if encoder_ids:  # they mark the rendered prompt, now the source: its KV is the request's own
            cache_breakpoints = ()
        num_prompt_tokens = len(prompt_token_ids)
        resolved = resolve_max_tokens(limits, num_prompt_tokens, max_tokens, info.max_model_len, prompt_param)
        sampling = build_sampling(
            fields.sampling_kwargs(), max_tokens=resolved, logprobs=logprobs, vocab_size=info.vocab_size
        )
        constraint = fields.constraint()
        if constraint is not None and self._grammars is not None:  # a 400 now, not on a worker
            await self._grammars.check_grammar(constraint.spec, constraint.param)
        stats.num_prompt_tokens = num_prompt_tokens + len(encoder_ids)
        return GenerationRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling=sampling,
            stop=fields.stop_strings(),
            timeout_s=timeout_s,
            session_key=session_key,
            cache_salt=cache_salt,
            cache_breakpoints=cache_breakpoints,
            encoder_token_ids=encoder_ids,
            priority=priority,
        )

    async def start(
        self,
        tenant_id: str,
        request: GenerationRequest,
        stats: RequestStats,
        *,
        request_charge: Reservation | None = None,
        result_key: str | None = None,
    ) -> GenerationStream:
        """Quotas (429), then a concurrency slot in the fair queue (503/529 when saturated), then the
        backend. The reservation is for prompt + n × max_tokens; it and the slot are given back when the
        stream closes, or here if starting fails. `result_key`: the exact-result cache's (Generator.start);
        a replayed result passes the quotas and the queue and is charged as a generated one is."""
        sampling = request.sampling
        num_input = len(request.prompt_token_ids) + len(request.encoder_token_ids)
        num_tokens = num_input + sampling.n * sampling.max_tokens
        with tracing.span("admission", attributes={"kvrelay.tenant": tenant_id}) as span:
            lease = await self.enter(
                tenant_id,
                num_tokens,
                request.timeout_s,
                request_charge=request_charge,
                priority=request.priority,
            )
            if lease.waited_s is not None:
                span.set_attribute("kvrelay.queue_wait_ms", round(lease.waited_s * 1000, 3))
        try:
            waited_s = lease.waited_s
            if waited_s is not None:
                stats.queue_wait_s = waited_s
                if request.timeout_s is not None:
                    request = replace(request, timeout_s=max(request.timeout_s - waited_s, 0.001))
            return await self._generator.start(request, stats, on_close=lease.close, result_key=result_key)
        except BaseException:
            await lease.close(None)  # does nothing when the failed stream's close already gave it back
            raise

    async def enter(
        self,
        tenant: str,
        num_tokens: int,
        timeout_s: float | None,
        *,
        request_charge: Reservation | None = None,
        priority: int = 0,
    ) -> Lease:
        """Reserves `num_tokens` (prompt + n × max_tokens) and, unless `charge_request` already counted
        it (`request_charge`), a request for `tenant`, then waits for a slot of class `priority` (higher
        classes first) until `timeout_s`. Raises
        RateLimitedError, QuotaUnavailableError or OverloadedError, holding nothing afterwards (a
        `request_charge` refunded)."""
        try:
            reservation = await self.quotas.reserve(
                tenant, num_tokens, "tokens" if request_charge is not None else None
            )
        except BaseException:
            if request_charge is not None:
                await self.quotas.refund(request_charge)
            raise
        weight, cap = self.fairness_of(tenant)
        try:
            slot = await self.limiter.acquire(
                tenant, weight=weight, cap=cap, timeout_s=timeout_s, priority=priority
            )
        except BaseException:
            await self.quotas.release(reservation)  # shielded inside
            if request_charge is not None:
                await self.quotas.refund(request_charge)
            raise
        return Lease(self.quotas, reservation, slot, request_charge)

    def fairness_of(self, tenant: str) -> tuple[int, int | None]:
        """(weight in the fair queue, concurrency cap or None) from quotas.tenants, else the defaults."""
        quotas = self._config.quotas
        own = quotas.tenants.get(tenant)
        if own is None:
            return 1, quotas.default_max_concurrency
        return own.weight, own.max_concurrency or quotas.default_max_concurrency

    async def aclose(self) -> None:
        await self.quotas.aclose()
