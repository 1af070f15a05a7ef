"""One generation, protocol-neutral: token IDs go to the backend, typed text events come back.

`Generator.start` sends the request and waits for the backend's first delta, so a backend that is
down or refuses the request raises before any response byte is written. The returned
`GenerationStream` yields, per sample (`index`):

    TextDelta*  then  SampleFinished        and, once every sample has finished,  Usage

Each sample owns one IncrementalDetokenizer and one StopStringMatcher: text is held back only while
it could still be the start of a stop string. When a stop string matches, the text is cut before it,
the sample finishes with reason STOP and the matched string, and once no sample is left running the
backend stream is closed, which aborts the request behind us. Logprobs ride on the next TextDelta of
their sample (a final TextDelta with empty text carries any left over). No protocol formatting here.

Step timeout: once the first delta has come, each next one must come within `limits.step_timeout_ms`
(the longest gap between two tokens of one request); past it the stream raises StepTimeoutError and
is closed, which aborts the request behind us. The wait for the first token is not a step (it
includes queueing and the whole prefill); the request timeout bounds it, and for an encoder-decoder
request `limits.encoder_timeout_ms` too (its queue, encoder pass and first step: EncoderTimeoutError,
a 504 before any byte).

`start(..., on_close=...)` runs an async callback once when the stream closes, however it closes, with
the tokens the request used (prompt + generated so far), or None when the backend produced nothing:
the admission gate (admission/gate.py) settles or releases its quota and slot there.

`start(..., result_key=...)`: the exact-result cache (backend/results.py). A stored result under the key
is replayed in place of the backend (which is never called); otherwise the backend's deltas are kept
and stored once every sample has finished here, never for a stream that failed, timed out or was left
before its end. `stats.result_cache` says which (hit or miss).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from services.codec.backend.protocol import (
    Backend,
    BackendFailedError,
    GenerationRequest,
    StepTimeoutError,
    TokenDelta,
)
from services.codec.backend.results import ResultCache, replay
from services.codec.errors import SERVER_ERROR, WireError
from services.codec.metrics import CodecMetrics, RequestStats
from services.codec.text.detokenizer import IncrementalDetokenizer
from services.codec.text.stop_strings import StopStringMatcher
from services.codec.text.tokenizer import Tokenizer
from services.common import tracing
from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams
from services.common.tenants import DEFAULT_TENANT

MIN_LOGPROB = -9999.0  # -inf is not JSON; OpenAI-compatible servers clamp to this


@dataclass(frozen=True)
class TextDelta:
    index: int
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class SampleFinished:
    index: int
    reason: FinishReason
    stop: str | None  # the stop string that matched, if one did
    num_tokens: int
    num_tool_calls: int = 0  # calls parsed from its text (protocols/output.py): a "tool_calls" finish


@dataclass(frozen=True)
class Usage:
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_tokens: int
    num_cache_written_tokens: tuple[int, ...] = ()  # per cache breakpoint the request carried


GenerationEvent = TextDelta | SampleFinished | Usage
OnClose = Callable[[int | None], Awaitable[None]]  # tokens used (prompt + generated), None: no output
Recorder = Callable[[Sequence[TokenDelta]], None]  # keeps a finished generation's deltas


def build_sampling(
    fields: Mapping[str, Any], *, max_tokens: int, logprobs: int | None, vocab_size: int | None
) -> SamplingParams:
    """SamplingParams from a protocol's fields; out-of-range values raise InvalidSamplingError (400)."""
    params = SamplingParams(**fields, max_tokens=max_tokens, logprobs=logprobs)
    params.validate(vocab_size)
    return params


class EncoderTimeoutError(StepTimeoutError):
    """An encoder-decoder request's first token took longer than `limits.encoder_timeout_ms`."""

    def __init__(self, timeout_s: float) -> None:
        BackendFailedError.__init__(
            self, f"no first token within {timeout_s * 1000:.0f} ms (limits.encoder_timeout_ms); aborted"
        )
        self.timeout_s = timeout_s

    def wire_error(self) -> WireError:
        return WireError(504, str(self), SERVER_ERROR, code="encoder_timeout")


class Generator:
    """Starts generations on one backend and counts them (for /status)."""

    def __init__(
        self,
        backend: Backend,
        tokenizer: Tokenizer,
        metrics: CodecMetrics,
        *,
        step_timeout_s: float | None = None,
        on_step_timeout: Callable[[], None] | None = None,
        results: ResultCache | None = None,
        encoder_timeout_s: float | None = None,
        on_encoder_timeout: Callable[[], None] | None = None,
    ) -> None:
        self.encoder_timeout_s = encoder_timeout_s  # an encoder-decoder request's first token
        self._on_encoder_timeout = on_encoder_timeout
        self._backend = backend
        self.results = results  # the exact-result cache; None: off
        self._tokenizer = tokenizer
        self._metrics = metrics
        self.step_timeout_s = step_timeout_s
        self._on_step_timeout = on_step_timeout
        self.num_running = 0
        self.num_requests_total = 0

    async def start(
        self,
        request: GenerationRequest,
        stats: RequestStats,
        *,
        on_close: OnClose | None = None,
        result_key: str | None = None,
    ) -> GenerationStream:
        """Sends `request` and waits for its first delta. Backend errors raise here, before any byte.
        `on_close` runs once when the stream closes (here too, if starting fails). `result_key`: answer
        from the exact-result cache when it holds the key, else store the result there."""
        results, tenant = self.results, stats.tenant_id or DEFAULT_TENANT
        stored = None
        if results is not None and result_key is not None:
            stored = await results.lookup(result_key, tenant)
            stats.result_cache = "miss" if stored is None else "hit"
        iterator = replay(stored) if stored is not None else aiter(self._backend.generate(request))
        record: Recorder | None = None
        if results is not None and result_key is not None and stored is None:
            record = functools.partial(results.store_later, result_key, tenant)
        self.num_requests_total += 1
        self.num_running += 1
        stream = GenerationStream(
            iterator,
            request,
            self._tokenizer,
            self._metrics,
            stats,
            self._on_close,
            step_timeout_s=self.step_timeout_s,
            on_step_timeout=self._on_step_timeout,
            first_timeout_s=self.encoder_timeout_s if request.encoder_token_ids else None,
            on_first_timeout=self._on_encoder_timeout,
            on_close_async=on_close,
            record=record,
        )
        try:
            await stream.prime()
        except BaseException:
            await stream.aclose()
            raise
        return stream

    def _on_close(self) -> None:
        self.num_running -= 1


class GenerationStream:
    """The events of one started generation. Iterate once; `aclose` is idempotent and aborts."""

    def __init__(
        self,
        iterator: AsyncIterator[TokenDelta],
        request: GenerationRequest,
        tokenizer: Tokenizer,
        metrics: CodecMetrics,
        stats: RequestStats,
        on_close: Callable[[], None],
        *,
        step_timeout_s: float | None = None,
        on_step_timeout: Callable[[], None] | None = None,
        first_timeout_s: float | None = None,
        on_first_timeout: Callable[[], None] | None = None,
        on_close_async: OnClose | None = None,
        record: Recorder | None = None,
    ) -> None:
        self._iterator = iterator
        self._first_timeout_s = first_timeout_s  # None: only the request's deadline bounds the first
        self._on_first_timeout = on_first_timeout
        self._record = record  # given every delta applied, once every sample has finished
        self._applied: list[TokenDelta] = []
        self._request = request
        self._metrics = metrics
        self._stats = stats
        self._on_close = on_close
        self._on_close_async = on_close_async
        self._step_timeout_s = step_timeout_s
        self._on_step_timeout = on_step_timeout
        self._samples = [_Sample(index, request, tokenizer) for index in range(request.sampling.n)]
        self._first: TokenDelta | None = None
        self._num_cached_tokens = 0
        self._num_deltas = 0
        self._num_generated_tokens = 0  # as the backend sent them, also past a stop string
        self._is_closed = False
        # One "detokenize" span per request, under the request's span (inactive when tracing is off).
        self._detokenize_trace = tracing.RepeatedStage("detokenize", tracing.current_context())

    @property
    def tokens_used(self) -> int | None:
        """Prompt + tokens generated so far, or None while the backend has produced nothing."""
        if not self._num_deltas:
            return None
        request = self._request
        return len(request.prompt_token_ids) + len(request.encoder_token_ids) + self._num_generated_tokens

    async def prime(self) -> None:
        self._first = await self._next_delta()
        if self._first is None:
            raise BackendFailedError("the backend ended the stream before the first token")

    def __aiter__(self) -> AsyncIterator[GenerationEvent]:
        return self._events()

    async def _events(self) -> AsyncIterator[GenerationEvent]:
        delta = self._first
        while delta is not None:
            for event in self._apply(delta):
                yield event
            if all(sample.is_finished for sample in self._samples):
                break
            delta = await self._next_delta()
        if not all(sample.is_finished for sample in self._samples):
            raise BackendFailedError("the backend stream ended before every sample finished")
        if any(sample.is_stopped_here for sample in self._samples):
            self._keep_result()
            await self.aclose()  # abort what the engine would still generate past the stop string
        else:
            await self._next_delta()  # the backend's own end of stream (it may still fail)
            self._keep_result()
        yield self._usage()

    def _keep_result(self) -> None:
        """Every sample finished here and the stream ended well: the result may be stored."""
        if self._record is not None:
            self._record(self._applied)

    def _apply(self, delta: TokenDelta) -> list[GenerationEvent]:
        self._stats.record_delta()
        if self._record is not None:
            self._applied.append(delta)
        if delta.num_cached_tokens >= self._num_cached_tokens and delta.num_cache_written_tokens:
            self._stats.num_cache_written_tokens = delta.num_cache_written_tokens  # counted with these
        self._num_cached_tokens = max(self._num_cached_tokens, delta.num_cached_tokens)
        if not 0 <= delta.index < len(self._samples):
            raise BackendFailedError(f"the backend sent a delta for unknown sample {delta.index}")
        if delta.finish_reason not in (None, FinishReason.STOP.value, FinishReason.LENGTH.value):
            raise BackendFailedError(f"the request ended in the serving stack ({delta.finish_reason})")
        with self._metrics.time_stage("detokenize", traced=False), self._detokenize_trace.run():
            events = self._samples[delta.index].apply(delta)
        self._stats.num_completion_tokens = sum(sample.num_tokens for sample in self._samples)
        self._stats.num_cached_tokens = self._num_cached_tokens
        return events

    def _usage(self) -> Usage:
        return Usage(
            # an encoder-decoder model reads its encoder input too: the prompt counts both
            num_prompt_tokens=len(self._request.prompt_token_ids) + len(self._request.encoder_token_ids),
            num_completion_tokens=sum(sample.num_tokens for sample in self._samples),
            num_cached_tokens=self._num_cached_tokens,
            num_cache_written_tokens=self._stats.num_cache_written_tokens,
        )

    async def _next_delta(self) -> TokenDelta | None:
        if self._is_closed:
            return None
        timeout_s = (
            self._step_timeout_s if self._num_deltas else self._first_timeout_s
        )  # the first is no step
        delta: TokenDelta | None = None
        try:
            with anyio.move_on_after(timeout_s) as step:
                delta = await anext(self._iterator)
        except StopAsyncIteration:
            return None
        if step.cancelled_caught:  # our deadline: cancelling `anext` aborted the backend stream
            if not self._num_deltas:  # the first token: an encoder-decoder request's encoder timeout
                if self._on_first_timeout is not None:
                    self._on_first_timeout()
                raise EncoderTimeoutError(timeout_s or 0.0)
            if self._on_step_timeout is not None:
                self._on_step_timeout()
            raise StepTimeoutError(timeout_s or 0.0)
        assert delta is not None
        self._num_deltas += 1
        self._num_generated_tokens += len(delta.token_ids)
        return delta

    async def aclose(self) -> None:
        """Closes the backend stream (aborting the request if it still runs). Safe to call twice."""
        if self._is_closed:
            return
        self._is_closed = True
        with anyio.CancelScope(shield=True):  # closing must finish even when the caller is cancelled
            try:
                aclose = getattr(self._iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._detokenize_trace.end()
                self._on_close()
                if self._on_close_async is not None:
                    await self._on_close_async(self.tokens_used)


class _Sample:
    """Streaming state of one sample: detokenizer, stop-string matcher, logprobs not yet sent."""

    def __init__(self, index: int, request: GenerationRequest, tokenizer: Tokenizer) -> None:
        self.index = index
        self.num_tokens = 0
        self.is_finished = False
        self.is_stopped_here = False  # finished by a stop string in the codec, not by the engine
        self._tokenizer = tokenizer
        self._num_top_logprobs = request.sampling.logprobs
        self._hidden_stop_ids = frozenset(request.sampling.stop_token_ids) | frozenset(
            tokenizer.eos_token_ids
        )
        self._detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
        self._matcher = StopStringMatcher(request.stop)
        self._pending: list[TokenLogprob] = []

    def apply(self, delta: TokenDelta) -> list[GenerationEvent]:
        if self.is_finished:
            return []  # stopped by a stop string; the engine may not have noticed yet
        self.num_tokens += len(delta.token_ids)
        if self._num_top_logprobs is not None:
            self._pending.extend(self._logprob(out) for out in delta.logprobs)
        text = self._detokenizer.push(self._visible_ids(delta))
        if delta.finish_reason is not None:
            text += self._detokenizer.flush()
        result = self._matcher.push(text)
        if result.stop is not None:
            self.is_stopped_here = True
            return self._finish(result.text, FinishReason.STOP, result.stop)
        if delta.finish_reason is not None:
            return self._finish(result.text + self._matcher.flush(), delta.finish_reason, None)
        return self._text(result.text)

    def _visible_ids(self, delta: TokenDelta) -> Sequence[int]:
        """The delta's tokens minus a final stop token (EOS or a user stop ID): it is not output text."""
        ids = delta.token_ids
        if delta.finish_reason == FinishReason.STOP and ids and ids[-1] in self._hidden_stop_ids:
            return ids[:-1]
        return ids

    def _text(self, text: str) -> list[GenerationEvent]:
        if not text:
            return []
        event = TextDelta(self.index, text, tuple(self._pending))
        self._pending.clear()
        return [event]

    def _finish(self, text: str, reason: FinishReason, stop: str | None) -> list[GenerationEvent]:
        self.is_finished = True
        events: list[GenerationEvent] = []
        if text or self._pending:
            events.append(TextDelta(self.index, text, tuple(self._pending)))
            self._pending.clear()
        events.append(SampleFinished(self.index, reason, stop, self.num_tokens))
        return events

    def _logprob(self, out: TokenLogprob) -> TokenLogprob:
        """`out` with the text of its token and of each alternative kept (logprobs clamped for JSON)."""
        top = [(tid, max(lp, MIN_LOGPROB)) for tid, lp in out.top[: self._num_top_logprobs or 0]]
        return TokenLogprob(
            token_id=out.token_id,
            logprob=max(out.logprob, MIN_LOGPROB),
            top=top,
            token=self._token_text(out.token_id),
            top_tokens=tuple(self._token_text(tid) for tid, _ in top),
        )

    def _token_text(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)
