"""An async client over the synchronous engine core, which runs in its own thread.

Services call `generate()` (an async stream of RequestOutput), `abort()` and `stats()`. Only the engine
thread touches the core's mutable state; callers talk to it through a command queue, and outputs come
back through each stream's asyncio queue. Closing a stream early (client gone, cancel, deadline) aborts
the request, so every KV block returns to the pool.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from services.common.engine_input import EngineInput, check_request, check_unique
from services.common.errors import EngineDeadError
from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore, EngineStats, RequestOutput
from services.engine.kv_export import KVExport
from services.kvcache.tier_set import TierEvent, TierReport

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[RequestOutput | BaseException]
    in_engine: bool = False  # its request reached the core (added, or its blocks reserved)

    def deliver(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


def _coalesce(
    item: RequestOutput | BaseException, outputs: asyncio.Queue[RequestOutput | BaseException]
) -> tuple[RequestOutput | BaseException, RequestOutput | BaseException | None]:
    """Merge the already-queued outputs of the same sample into `item`: when the reader falls behind
    (a slow hop, a busy CPU), it then sends one message with several tokens instead of one per token.
    Returns the merged output and the first queued item that could not be merged, if any."""
    while isinstance(item, RequestOutput) and not item.finished and not outputs.empty():
        following = outputs.get_nowait()
        if not isinstance(following, RequestOutput) or following.index != item.index:
            return item, following
        item = replace(
            following,
            new_token_ids=item.new_token_ids + following.new_token_ids,
            logprobs=None if item.logprobs is None else item.logprobs + (following.logprobs or []),
            encode_times_ns=item.encode_times_ns or following.encode_times_ns,
        )
    return item, None


def _put_all(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, output in items:
        stream.outputs.put_nowait(output)


def _settle(future: asyncio.Future[int | None], value: int | None, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


@dataclass(frozen=True)
class KVEventBatch:
    """Changes to the prefix cache's block hashes; `snapshot` batches list everything cached."""

    snapshot: bool
    stored: list[bytes]
    removed: list[bytes]
    tiers: list[TierEvent] = field(default_factory=list)  # segments the tiers below gained or lost


MAX_PENDING_KV_BATCHES = 1024  # a subscriber this far behind is dropped; it re-subscribes for a snapshot


@dataclass(eq=False)
class _KVSubscriber:
    loop: asyncio.AbstractEventLoop
    batches: asyncio.Queue[KVEventBatch | None]

    def deliver(self, batch: KVEventBatch | None) -> None:
        self.loop.call_soon_threadsafe(self.batches.put_nowait, batch)


class StepObserver(Protocol):
    """Told about every engine step, on the engine thread: keep it cheap and thread-safe."""

    def observe_step(
        self, seconds: float, num_tokens: int, queue_times: list[float], encoder_times: Sequence[float] = ()
    ) -> None: ...


class AsyncEngine:
    def __init__(self, core: EngineCore, observer: StepObserver | None = None) -> None:
        self.core = core
        self.observer = observer
        core.enable_kv_events()
        self._kv_subscribers: list[_KVSubscriber] = []
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._error: BaseException | None = None
        self._stats = core.stats()
        self._undelivered: list[RequestOutput] = []
        core.set_before_forward(self._deliver_outputs)
        core.set_wake(self._wake.set)  # a tier lookup ended: its request may be admitted now
        self.last_step_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)

    @classmethod
    def launch(cls, build: Callable[[], EngineCore], observer: StepObserver | None = None) -> AsyncEngine:
        """Build the core on the engine thread and run the loop there; returns once the core is built.

        Everything the engine computes (loading, weight conversion, steps) then runs on one thread. libgomp
        keeps one thread pool per thread that opens a parallel region; with two pools (weights converted
        on the main thread, steps on the engine thread) it counts more threads than cores and stops
        spinning at its barriers, so every step waits on futex wake-ups (measured: a quarter slower at
        batch 32 on 2 cores)."""
        built: queue.SimpleQueue[AsyncEngine | BaseException] = queue.SimpleQueue()

        def run() -> None:
            try:
                engine = cls(build(), observer)
            except BaseException as exc:
                built.put(exc)
                return
            engine._thread = threading.current_thread()
            built.put(engine)
            engine._run()

        threading.Thread(target=run, name="engine-core", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def start(self) -> None:
        """Start the loop on its own thread (a no-op for an engine made by `launch`, already running)."""
        if self._thread.ident is None:
            self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.core.close()

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def stats(self) -> EngineStats:
        """The snapshot taken after the last step (cheap, thread-safe)."""
        return self._stats

    def tier_report(self) -> TierReport | None:
        """The KV tiers' counts now (on the caller's thread), None without tiers."""
        return self.core.tier_report()

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size, for the services that check a request before `generate_checked`."""
        return self.core.vocab_size

    @property
    def device(self) -> torch.device:
        """Where the KV cache lives (received KV is assembled there)."""
        return self.core.device

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        priority: int = 0,
        cache_salt: bytes = b"",
        export_kv_from: int | None = None,
        encoder_token_ids: Sequence[int] = (),
    ) -> AsyncGenerator[RequestOutput, None]:
        """The entry for callers that hold raw values: checks them (engine_input.check_request) and refuses
        an ID that already has a stream here, then runs it (`generate_checked`)."""
        request = check_request(
            request_id, prompt_token_ids, params, self.vocab_size,
            priority=priority, cache_salt=cache_salt, encoder_token_ids=encoder_token_ids,
        )  # fmt: skip
        check_unique(request_id, self._streams)  # never take over a running request's stream
        async for item in self.generate_checked(request, export_kv_from=export_kv_from):
            yield item

    async def generate_checked(
        self, request: EngineInput, *, export_kv_from: int | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream one output per new token of a checked request until all n sequences finish. Its caller
        holds the ID (the worker's in-flight set, or `generate`): nothing here checks it again. With
        `export_kv_from` (prefill replica) the one output carries the prompt's KV (`output.kv`)."""
        stream = self._open(request.request_id)
        self._submit(lambda: self._add(request, export_kv_from))
        async for item in self._outputs(request.request_id, stream, request.params.n):
            yield item

    async def reserve_remote(self, request: EngineInput) -> int | None:
        """Decode replica: reserve blocks for a checked request whose prompt KV comes from a prefill replica
        (its caller holds the ID). Returns the prompt tokens already cached here, or None (no room: nothing
        is held, use `generate_checked`). After a reservation the caller must end with `install_remote` or
        `resume_local` and read `outputs`, or `abort` the request."""
        request_id = request.request_id
        stream = self._open(request_id)
        loop = asyncio.get_running_loop()
        result: asyncio.Future[int | None] = loop.create_future()

        def reserve() -> None:
            try:
                num_skip = self.core.reserve(request)
            except Exception as exc:  # a typed error for the caller, not the loop
                loop.call_soon_threadsafe(_settle, result, None, exc)
                return
            stream.in_engine = num_skip is not None
            loop.call_soon_threadsafe(_settle, result, num_skip, None)

        self._submit(reserve)
        try:
            num_skip = await result
        except BaseException:
            self.release(request_id)  # runs after the reservation, so nothing stays held
            raise
        if num_skip is None:
            self._streams.pop(request_id, None)
        return num_skip

    def install_remote(self, request_id: str, first: TokenLogprob, export: KVExport) -> None:
        """Write the received KV into the reservation and decode on; errors arrive on `outputs`."""
        self._submit(lambda: self._deliver_errors(request_id, self.core.install_remote, first, export))

    def resume_local(self, request_id: str, first: TokenLogprob | None) -> None:
        """Compute the reserved request's prompt (and `first`, if already sent) here instead."""
        self._submit(lambda: self._deliver_errors(request_id, self.core.resume_local, first))

    async def outputs(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of a reserved request after `install_remote` or `resume_local`."""
        stream = self._streams.get(request_id)
        if stream is None:
            raise KeyError(f"no open stream for request {request_id!r}")
        async for item in self._outputs(request_id, stream, 1):
            yield item

    def release(self, request_id: str) -> None:
        """Forget a request's stream and abort whatever of it the engine still holds (idempotent)."""
        self._streams.pop(request_id, None)
        self.abort(request_id)

    def end_reserved(self, request_id: str, reason: FinishReason) -> None:
        """Forget a reserved request that the prefill replica's first token finished (not an abort)."""
        self._streams.pop(request_id, None)
        self._submit(lambda: self.core.end_reserved(request_id, reason))

    def _open(self, request_id: str) -> _Stream:
        if self._error is not None:
            raise EngineDeadError("the engine loop has stopped") from self._error
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        return stream

    async def _outputs(
        self, request_id: str, stream: _Stream, num_open: int
    ) -> AsyncGenerator[RequestOutput, None]:
        held: RequestOutput | BaseException | None = None
        try:
            while num_open:
                item = held if held is not None else await stream.outputs.get()
                item, held = _coalesce(item, stream.outputs)
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    num_open -= 1
                yield item
        finally:
            if self._streams.get(request_id) is stream:  # not a newer stream under the same ID (a retry)
                del self._streams[request_id]
            if num_open:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self._abort(request_id))

    async def kv_events(self) -> AsyncGenerator[KVEventBatch, None]:
        """A snapshot of the cached block hashes, then every change, until the caller stops (or falls
        more than MAX_PENDING_KV_BATCHES behind, when the stream ends and the caller re-subscribes)."""
        subscriber = _KVSubscriber(asyncio.get_running_loop(), asyncio.Queue())
        self._submit(lambda: self._subscribe(subscriber))
        try:
            while (batch := await subscriber.batches.get()) is not None:
                yield batch
        finally:
            self._submit(lambda: self._unsubscribe(subscriber))

    def _submit(self, command: Callable[[], None]) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- engine thread ------------------------------------------------------------------------------

    def _add(self, request: EngineInput, export_kv_from: int | None) -> None:
        stream = self._streams.get(request.request_id)
        if stream is None:  # the caller went away before its request reached the engine
            return
        try:
            self.core.add(request, export_kv_from=export_kv_from)
        except Exception as exc:  # a typed error for the caller, not the loop
            stream.deliver(exc)
            return
        stream.in_engine = True

    def _deliver_errors(self, request_id: str, command: Callable[..., None], *args: object) -> None:
        try:
            command(request_id, *args)
        except Exception as exc:  # a typed error for the caller, not the loop
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.deliver(exc)

    def _subscribe(self, subscriber: _KVSubscriber) -> None:
        subscriber.deliver(KVEventBatch(True, self.core.cached_block_hashes(), []))
        self._kv_subscribers.append(subscriber)

    def _unsubscribe(self, subscriber: _KVSubscriber) -> None:
        if subscriber in self._kv_subscribers:
            self._kv_subscribers.remove(subscriber)

    def _publish_kv_events(self) -> None:
        events = self.core.take_kv_events()
        tiers = self.core.take_tier_events()
        if not (events or tiers) or not self._kv_subscribers:
            return
        batch = KVEventBatch(
            False,
            [e.block_hash for e in events if e.kind == "stored"],
            [e.block_hash for e in events if e.kind == "removed"],
            tiers,
        )
        for subscriber in list(self._kv_subscribers):
            if subscriber.batches.qsize() > MAX_PENDING_KV_BATCHES:
                self._kv_subscribers.remove(subscriber)
                subscriber.deliver(None)
            else:
                subscriber.deliver(batch)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        ends = self.core.abort_request(request_id)  # whatever runs under the ID
        # A stream whose request is in the engine and still read (Worker.Abort by ID) gets the ends; a
        # closed stream, or one whose request never reached the engine, gets nothing.
        if stream is not None and stream.in_engine and ends:
            self._deliver_outputs()  # the last step's tokens first, then the end
            for end in ends:
                stream.deliver(end)

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                self._publish_kv_events()
                if not self.core.has_work():
                    self._deliver_outputs()
                    self._stats = self.core.stats()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                started = time.monotonic()
                outputs = self.core.step()
                self._publish_kv_events()
                self.last_step_time = time.monotonic()
                self._observe(self.last_step_time - started, outputs)
                self._stats = self.core.stats()
                self._deliver_outputs()  # a step that ran no forward (or a first step) leaves some
                self._undelivered = outputs  # handed out just before the next forward, or when idle
                if self.core.is_stalled() and not outputs:
                    # Nothing could run (waiting for tier lookups, or for KV room): sleep until a
                    # command or a lookup wakes the loop, not in a spin.
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as exc:
            log.exception("engine loop stopped")
            self._error = exc
            for stream in list(self._streams.values()):
                stream.deliver(EngineDeadError("the engine loop stopped"))

    def _deliver_outputs(self) -> None:
        """Hand the last step's outputs to their streams: one wake-up per event loop, not one per token."""
        outputs, self._undelivered = self._undelivered, []
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput]]] = {}
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, output))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)

    def _observe(self, seconds: float, outputs: list[RequestOutput]) -> None:
        queue_times, encoder_times = self.core.take_queue_times(), self.core.take_encoder_times()
        if self.observer is not None:
            self.observer.observe_step(seconds, len(outputs), queue_times, encoder_times)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()
