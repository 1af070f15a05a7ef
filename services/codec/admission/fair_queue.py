"""Concurrency caps and the bounded fair queue in front of the backend.

A request needs a slot to run (from just before it is sent to the backend until its generation stream
closes). At most `limits.concurrency_limit` slots are held overall, and at most the tenant's cap
(`quotas.tenants[t].max_concurrency`, else `quotas.default_max_concurrency`; unset: only the overall
cap). A request that cannot run waits in its tenant's FIFO queue; at most `limits.queue_limit` wait in
all.

Who goes next is weighted fair queuing by start tags (as in stride scheduling): each tenant has a
virtual time that every slot it gets advances by 1 / weight (`quotas.tenants[t].weight`, default 1),
and a freed slot goes to the waiting tenant with the smallest virtual time that is under its own cap
(ties: the oldest waiter). A tenant that was idle starts at the current virtual time, so idling banks
no credit. With equal weights, tenants with waiters take turns (round-robin), whatever their arrival
order; a tenant of weight 2 gets two slots per turn of a weight-1 tenant.

Priority classes (services/common/priority.py) come first: a freed slot goes to the waiting request of the
highest class, and fair queuing decides among the tenants whose best waiter is of that class. Within a
tenant, waiters queue by class, then arrival.

Queue full: when the arriving tenant holds less than its fair share of the queue (per weight) than
the tenant holding the most, that tenant's newest waiter is refused instead (reason
"queue_pushed_out") and the arrival queues; otherwise the arrival is refused ("queue_full"). So one
tenant flooding the queue cannot take all of it from the others. Both are OverloadedError: 503, or
529 overloaded_error on Anthropic's routes, with Retry-After.

Waiting is bounded by the request's own deadline (`limits.request_timeout_ms`, or a gRPC client's
shorter deadline), not by a separate setting: past it the request is refused ("queue_timeout"). A
waiter whose client leaves is cancelled, which takes it out of the queue at once; if a slot was handed
to it in the same instant, the slot passes on to the next waiter.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import anyio

from services.codec.admission.errors import OverloadedError
from services.codec.admission.metrics import LimitsMetrics


@dataclass(eq=False)
class _Waiter:
    tenant: str
    seq: int
    future: asyncio.Future[None]
    priority: int = 0
    is_granted: bool = False

    @property
    def order(self) -> tuple[int, int]:
        return (self.priority, self.seq)


@dataclass(eq=False)
class _TenantState:
    weight: int = 1
    cap: int | None = None
    running: int = 0
    virtual_time: float = 0.0  # after its last grant
    queue: deque[_Waiter] = field(default_factory=deque)

    @property
    def share(self) -> float:
        return len(self.queue) / self.weight


class Slot:
    """One held slot. `release` is idempotent. `waited_s` is the time spent queued (None: no wait)."""

    def __init__(self, limiter: FairLimiter, tenant: str, waited_s: float | None = None) -> None:
        self._limiter = limiter
        self.tenant = tenant
        self.waited_s = waited_s
        self._is_released = False

    def release(self) -> None:
        if not self._is_released:
            self._is_released = True
            self._limiter._release(self.tenant)


class FairLimiter:
    def __init__(self, capacity: int, queue_limit: int, metrics: LimitsMetrics | None = None) -> None:
        self.capacity = capacity
        self.queue_limit = queue_limit
        self._metrics = metrics
        self._tenants: dict[str, _TenantState] = {}
        self._virtual_time = 0.0
        self._num_running = 0
        self._num_waiting = 0
        self._seq = itertools.count()
        if metrics is not None:
            metrics.running.set_function(lambda: self._num_running)
            metrics.queued.set_function(lambda: self._num_waiting)

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    def running_of(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return state.running if state else 0

    def waiting_of(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return len(state.queue) if state else 0

    async def acquire(
        self,
        tenant: str,
        *,
        weight: int = 1,
        cap: int | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
    ) -> Slot:
        """A slot for `tenant`, at once or after waiting its turn; OverloadedError when refused."""
        state = self._tenants.setdefault(tenant, _TenantState())
        state.weight, state.cap = weight, cap
        if not state.queue and self._has_room(state):
            self._grant(state)
            return Slot(self, tenant)
        if self._num_waiting >= self.queue_limit:
            try:
                self._make_room(tenant, state, priority)
            except OverloadedError:
                self._forget_if_idle(tenant, state)
                raise
        waiter = _Waiter(tenant, next(self._seq), asyncio.get_running_loop().create_future(), priority)
        if not state.queue:  # it was idle: it starts now, with no credit from before
            state.virtual_time = max(state.virtual_time, self._virtual_time)
        state.queue.insert(bisect.bisect_right([w.order for w in state.queue], waiter.order), waiter)
        self._num_waiting += 1
        queued_at = time.monotonic()
        try:
            with anyio.fail_after(timeout_s):
                await waiter.future
        except TimeoutError:
            self._leave(waiter)
            self._count(tenant, "queue_timeout")
            raise OverloadedError(
                "the request waited for a free slot until its deadline", "queue_timeout"
            ) from None
        except OverloadedError as exc:  # pushed out of the queue by a tenant with a smaller share
            self._count(tenant, exc.reason)
            raise
        except BaseException:  # cancelled: the client left
            self._leave(waiter)
            raise
        return Slot(self, tenant, time.monotonic() - queued_at)

    def _has_room(self, state: _TenantState) -> bool:
        return self._num_running < self.capacity and (state.cap is None or state.running < state.cap)

    def _grant(self, state: _TenantState) -> None:
        start = max(state.virtual_time, self._virtual_time)
        state.virtual_time = start + 1.0 / state.weight
        self._virtual_time = start
        state.running += 1
        self._num_running += 1

    def _make_room(self, tenant: str, arriving: _TenantState, priority: int) -> None:
        """Pushes out the newest lowest-class waiter of the tenant most over its share, else refuses the
        arrival; never a waiter of a higher class than the arrival's."""
        held = [s for s in self._tenants.values() if s.queue and s.queue[-1].priority >= priority]
        victim = max(held, key=lambda s: (s.share, s.queue[-1].seq)) if held else None
        fair = victim is not None and victim.share > (len(arriving.queue) + 1) / arriving.weight
        if victim is None or victim is arriving or not fair:
            self._count(tenant, "queue_full")
            raise OverloadedError(
                f"the server is saturated: {self._num_waiting} requests are already waiting; retry later"
            )
        pushed = victim.queue.pop()
        self._num_waiting -= 1
        if not pushed.future.done():  # done: cancelled, and its cleanup has not run yet
            pushed.future.set_exception(
                OverloadedError(
                    "the server is saturated and this request's tenant holds most of the queue; retry later",
                    "queue_pushed_out",
                )
            )
        self._forget_if_idle(pushed.tenant, victim)

    def _leave(self, waiter: _Waiter) -> None:
        """Takes a waiter that gave up out of the queue, or passes on the slot it was just granted."""
        state = self._tenants.get(waiter.tenant)
        if waiter.is_granted:
            self._release(waiter.tenant)
        elif state is not None:
            if waiter in state.queue:  # else a dispatch or a push-out took it out already
                state.queue.remove(waiter)
                self._num_waiting -= 1
            self._forget_if_idle(waiter.tenant, state)

    def _release(self, tenant: str) -> None:
        state = self._tenants[tenant]
        state.running -= 1
        self._num_running -= 1
        self._dispatch()
        self._forget_if_idle(tenant, state)

    def _dispatch(self) -> None:
        while self._num_running < self.capacity:
            best: _TenantState | None = None
            for state in self._tenants.values():
                if state.queue and (state.cap is None or state.running < state.cap):
                    head = state.queue[0]
                    key = (head.priority, state.virtual_time, head.seq)
                    if best is None or key < (best.queue[0].priority, best.virtual_time, best.queue[0].seq):
                        best = state
            if best is None:
                return
            waiter = best.queue.popleft()
            self._num_waiting -= 1
            if waiter.future.done():  # cancelled a moment ago; its cleanup will find it gone
                continue
            self._grant(best)
            waiter.is_granted = True
            waiter.future.set_result(None)

    def _forget_if_idle(self, tenant: str, state: _TenantState) -> None:
        """Drops a tenant with nothing running or queued and no virtual time ahead of the clock."""
        if not state.queue and not state.running and state.virtual_time <= self._virtual_time:
            self._tenants.pop(tenant, None)

    def _count(self, tenant: str, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.reject(tenant, reason)
