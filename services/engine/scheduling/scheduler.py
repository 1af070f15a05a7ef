"""The scheduler counts tokens per request, not phases.

Each step hands every request some number of tokens so its computed tokens catch up with its known
tokens. A fresh prompt, a chunk of a long prompt, a decode token, a prefix hit and a recompute after
preemption all fall out of that one rule, under one token budget and a cap on sequences per step.
Running requests go first; when a running request cannot grow, the newest lowest-priority request not
yet scheduled this step is preempted (its blocks are freed and it will be recomputed, mostly from the
prefix cache). Waiting requests are admitted while the budget, the sequence cap and the KV pool allow,
and only in steps where no running request had to preempt to grow.

Priority classes (`Request.priority`, lower runs first; docs/priority.md) order all of it: a step serves
the classes in turn, each one's running requests then its waiting ones, so a higher class has the budget
and the sequence cap first. A waiting request that finds the KV pool or the sequence cap full takes the
room of running requests of lower classes (newest first), which are preempted; when it still cannot be
admitted, no lower class is admitted in that step. With one class this is plain FCFS.

A step's results land in two parts: `advance` once it is launched (its chunks are computed; each sampled
token is a placeholder), `resolve` once its tokens are read back (tokens in, stops checked). `update`
does both at once. Between them the next step may be scheduled (core.py overlaps the two): it computes
each placeholder from the device, and skips a sequence that a pending token ends whatever it is.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from services.common.outputs import FinishReason, TokenLogprob
from services.engine.scheduling.block_pool import NO_BLOCK
from services.engine.scheduling.kv_manager import KVCacheManager
from services.engine.scheduling.request import Request, RequestStatus, SeqId


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int
    start_position: int  # == request.num_computed_tokens when scheduled

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the known tokens, so a new token is sampled."""
        return self.start_position + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class PendingToken:
    """A sampled token not read back yet: its sequence, and its index in the sequence's token_ids."""

    request: Request
    index: int


@dataclass(frozen=True)
class StepUpdate:
    request: Request
    token: TokenLogprob
    finish_reason: FinishReason | None


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted_ids: list[SeqId] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class FetchedKV(Protocol):
    """KV for `num_tokens` tokens after a request's cached prefix, found below the pool."""

    num_tokens: int

    def place(self, block_ids: list[int], start: int) -> None:
        """Write the KV into the request's blocks at positions start.. ."""
        ...


class BelowPool(Protocol):
    """The KV tiers below the pool (engine/kv_tiers.py), as the scheduler sees them."""

    def look(self, request: Request, num_cached_tokens: int) -> None:
        """A new request: start looking up what follows the pool's hit of `num_cached_tokens` (elsewhere)."""
        ...

    def is_looking(self, request: Request) -> bool:
        """Whether its lookup still runs: it is not admitted meanwhile (others are)."""
        ...

    def found(self, request: Request, num_cached_tokens: int) -> FetchedKV | None:
        """What its lookup found past the pool's hit of `num_cached_tokens` now, or None."""
        ...

    def on_finish(self, request: Request, reason: FinishReason) -> None:
        """It leaves (its blocks still held): its finished segments may be written down."""
        ...


@dataclass
class Scheduler:
    kv: KVCacheManager
    max_num_batched_tokens: int
    max_num_seqs: int
    waiting: list[Request] = field(default_factory=list)
    running: list[Request] = field(default_factory=list)
    requests: dict[SeqId, Request] = field(default_factory=dict)
    num_preemptions: int = 0
    num_generated_tokens: int = 0  # tokens sampled (appended in `update`), never reset
    # Encoder-decoder models: the source tokens the sequences admitted in one step may bring to the
    # encoder (batched, never chunked); one is always admitted, however long. None: no encoder.
    max_num_encoder_tokens: int | None = None
    # The tiers below the pool, if any: a new request (a group's leader) starts a lookup there; KV it
    # found is placed into blocks allocated with the request's at admission, before its first chunk is
    # sized (it costs no compute budget); each request that leaves through `finish` is shown to them
    # before its blocks go back.
    below: BelowPool | None = None
    # Seconds each newly admitted request waited since arrival, until `take_queue_times`.
    _queue_times: list[float] = field(default_factory=list, init=False)

    def add(self, request: Request) -> None:
        """Queue a new request (it waits for admission)."""
        self.requests[request.seq_id] = request
        self._enqueue(request)
        if self.below is not None and request.group_leader_id is None:
            self.below.look(request, len(self.kv.peek_cached_prefix(request)) * self.kv.block_size)

    def reserve(self, request: Request) -> bool:
        """Take in a new request whose prompt KV will arrive from a prefill replica: hold its cached
        prefix plus room for the rest of the prompt and the first token, and mark it WAITING_FOR_KV (in
        neither queue). False, with nothing held or registered, if the pool is short."""
        cached = self.kv.find_cached_prefix(request)
        num_new = request.num_tokens - len(cached) * self.kv.block_size + 1
        if not self.kv.admit(request, cached, num_new):
            return False
        request.record_admission(request.num_computed_tokens)
        request.status = RequestStatus.WAITING_FOR_KV
        self.requests[request.seq_id] = request
        return True

    def live_samples(self, parent_id: str) -> list[Request]:
        """The samples of request `parent_id` still held here (waiting, running or reserved), by index."""
        samples = [r for r in self.requests.values() if r.parent_id == parent_id]
        return sorted(samples, key=lambda r: r.sample_index)

    def take_queue_times(self) -> list[float]:
        """The queue times (seconds from arrival to first admission) recorded since the last call."""
        queue_times, self._queue_times = self._queue_times, []
        return queue_times

    def start_remote(self, request: Request) -> None:
        """A reserved request whose prompt KV is now written: it joins the running batch."""
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.commit(request)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def requeue(self, request: Request) -> None:
        """A reserved request whose KV will not come: free its blocks and compute it here instead."""
        self.kv.release(request)
        request.num_computed_tokens = 0
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        keys = [r.sort_key for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, request.sort_key), request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: set[SeqId] = set()
        classes = sorted({r.priority for r in self.running} | {r.priority for r in self.waiting})
        admitting = True
        for priority in classes:
            num_preempted = len(out.preempted_ids)
            budget = self._schedule_running(priority, out, budget, scheduled)
            # A running request that had to preempt to grow: the pool is short, admit no one this step.
            admitting = admitting and len(out.preempted_ids) == num_preempted
            if admitting:
                budget, admitting = self._admit_waiting(priority, out, budget, scheduled)
        return out

    def _schedule_running(
        self, priority: int, out: SchedulerOutput, budget: int, scheduled: set[SeqId]
    ) -> int:
        for request in [r for r in self.running if r.priority == priority]:
            if budget <= 0 or len(out.chunks) >= self.max_num_seqs:
                break
            if request.seq_id in out.preempted_ids or request.ends_when_resolved:
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._grow_or_preempt(request, num_new, scheduled, out):
                continue
            out.chunks.append(ScheduledChunk(request, num_new, request.num_computed_tokens))
            scheduled.add(request.seq_id)
            budget -= num_new
        return budget

    def _grow_or_preempt(
        self, request: Request, num_new: int, scheduled: set[SeqId], out: SchedulerOutput
    ) -> bool:
        while not self.kv.grow(request, num_new):
            victim = self._victim(lambda r: r is not request and r.seq_id not in scheduled) or request
            self._preempt(victim)
            out.preempted_ids.append(victim.seq_id)
            if victim is request:
                return False
        return True

    def _victim(self, eligible: Callable[[Request], bool]) -> Request | None:
        """The running request to preempt among the `eligible`: the lowest class, the newest."""
        victims = self._victims(eligible)
        return max(victims, key=lambda r: r.sort_key) if victims else None

    def _victims(self, eligible: Callable[[Request], bool]) -> list[Request]:
        """The running requests that may be preempted among the `eligible`. Never a sequence a pending
        token ends: it frees its blocks once read back, and a prefill replica's still has its prompt KV to
        export from them."""
        return [r for r in self.running if eligible(r) and not r.ends_when_resolved]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.release(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request)

    def _admit_waiting(
        self, priority: int, out: SchedulerOutput, budget: int, scheduled: set[SeqId]
    ) -> tuple[int, bool]:
        """Admit the waiting requests of class `priority`, in order, while they fit; the budget left, and
        whether lower classes may still be admitted (False: one of this class could not be)."""
        encoder_budget, num_encoded = self.max_num_encoder_tokens, 0
        for request in [r for r in self.waiting if r.priority == priority]:
            if request.seq_id in out.preempted_ids:
                return budget, False  # preempted in this step to make room: its class waits for the next
            if self._leader_still_prefilling(request) or self._still_looking(request):
                continue
            if budget <= 0 or len(out.chunks) >= self.max_num_seqs:
                return budget, False  # the step is full with this class and the ones above it
            num_source = len(request.encoder_token_ids)
            if encoder_budget is not None and num_encoded and num_encoded + num_source > encoder_budget:
                return budget, False  # the step's encoder budget is spent; keep FCFS order
            cached = self.kv.find_cached_prefix(request)
            num_cached_tokens = len(cached) * self.kv.block_size
            below = self.below.found(request, num_cached_tokens) if self.below is not None else None
            num_below = below.num_tokens if below is not None else 0
            num_new = min(request.num_tokens - num_cached_tokens - num_below, budget)
            while not self.kv.admit(request, cached, num_below + num_new):
                # Lower classes' running requests give up their blocks (they are not scheduled yet: the
                # classes are served in order), newest first, but only when all of them together would
                # make room; otherwise admission is bounded by KV memory; keep FCFS.
                victims = self._victims(lambda r: r.priority > priority and r.seq_id not in scheduled)
                if self.kv.shortfall(request, cached, num_below + num_new) > self.kv.freeable(victims):
                    return budget, False
                victim = max(victims, key=lambda r: r.sort_key)
                self._preempt(victim)
                out.preempted_ids.append(victim.seq_id)
            if below is not None:
                below.place(request.block_ids, num_cached_tokens)
                request.num_computed_tokens += num_below
                self.kv.commit(request)
                num_cached_tokens += num_below
            if request.record_admission(num_cached_tokens):
                self._queue_times.append(time.monotonic() - request.arrival_time)
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new, request.num_computed_tokens))
            scheduled.add(request.seq_id)
            budget -= num_new
            num_encoded += num_source
        return budget, True

    def _still_looking(self, request: Request) -> bool:
        return self.below is not None and self.below.is_looking(request)

    def _leader_still_prefilling(self, request: Request) -> bool:
        if request.group_leader_id is None:
            return False
        leader = self.requests.get(request.group_leader_id)
        if leader is None or leader.is_finished:
            return False
        return leader.num_computed_tokens < leader.num_prompt_tokens - 1

    def update(self, step: SchedulerOutput, sampled: Mapping[SeqId, TokenLogprob]) -> list[StepUpdate]:
        """Advance each scheduled request past its chunk, append sampled tokens and finish the done."""
        return self.resolve(self.advance(step), sampled)

    def advance(self, step: SchedulerOutput) -> list[PendingToken]:
        """A launched step's chunks are computed: move each request past its chunk, commit its full
        blocks, and hold a placeholder for each token the step samples. Returns those placeholders."""
        pending = []
        for chunk in step.chunks:
            request = chunk.request
            samples = chunk.samples  # read before the placeholder changes the request's length
            request.num_computed_tokens += chunk.num_new_tokens
            self.kv.commit(request)
            self.kv.free_out_of_window(request)
            if samples:
                pending.append(PendingToken(request, request.num_tokens))
                request.append_placeholder()
        return pending

    def resolve(self, pending: list[PendingToken], sampled: Mapping[SeqId, TokenLogprob]) -> list[StepUpdate]:
        """A step's sampled tokens are read back: write them over their placeholders, check stops and
        finish the done. A sequence that ended meanwhile (aborted, or stopped by an earlier token) is
        skipped; one preempted meanwhile takes its token and is recomputed with it."""
        updates = []
        for item in pending:
            request, token = item.request, sampled.get(item.request.seq_id)
            if request.is_finished:
                continue
            if token is None:
                raise RuntimeError(f"the runner sampled no token for {request.seq_id}")
            request.resolve_token(item.index, token.token_id)
            self.kv.commit(request)
            self.num_generated_tokens += 1
            if request.params.logprobs is not None:
                request.logprobs.append(token)
            reason = request.check_stop(item.index)
            if reason is not None:
                self.finish(request, reason)
            updates.append(StepUpdate(request, token, reason))
        return updates

    def finish(self, request: Request, reason: FinishReason) -> None:
        """Take a request out of the scheduler and free its blocks (prefix blocks stay cached)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.commit(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        # WAITING_FOR_KV requests sit in neither list; releasing their reservation is all.
        if self.below is not None:
            self.below.on_finish(request, reason)
        self.kv.release(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.requests.pop(request.seq_id, None)

    def held_block_refs(self) -> dict[int, int]:
        """How many references the live requests hold on each block: for invariant checks."""
        refs: dict[int, int] = {}
        reserved = [r for r in self.requests.values() if r.status is RequestStatus.WAITING_FOR_KV]
        for request in self.running + reserved:
            for block_id in (*request.block_ids, *request.cross_block_ids):
                if block_id != NO_BLOCK:
                    refs[block_id] = refs.get(block_id, 0) + 1
        return refs
