"""The fair limiter: global and per-tenant caps, weighted fair order, the bounded queue, cancellation."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import Gauge

from services.codec.admission.errors import OverloadedError
from services.codec.admission.fair_queue import FairLimiter, Slot
from services.codec.admission.metrics import LimitsMetrics


def gauge(instrument: Gauge) -> float:
    return next(iter(instrument.collect())).samples[0].value


async def settle() -> None:
    """Lets every ready task run (a few loop turns)."""
    for _ in range(5):
        await asyncio.sleep(0)


class Recorder:
    """Starts acquirers and records the order in which they get their slot."""

    def __init__(self, limiter: FairLimiter) -> None:
        self.limiter = limiter
        self.order: list[str] = []
        self.slots: dict[str, Slot] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def start(self, name: str, tenant: str, **kwargs: object) -> None:
        async def run() -> None:
            slot = await self.limiter.acquire(tenant, **kwargs)  # type: ignore[arg-type]
            self.order.append(name)
            self.slots[name] = slot

        self.tasks[name] = asyncio.create_task(run())
        await settle()

    async def release(self, name: str) -> None:
        self.slots[name].release()
        await settle()

    async def drain(self) -> None:
        """Releases each granted slot in turn until nothing waits."""
        released: set[str] = set()
        while len(released) < len(self.tasks):
            pending = [n for n in self.order if n not in released]
            assert pending, "a waiter never got its slot"
            released.add(pending[0])
            await self.release(pending[0])


async def test_slots_up_to_the_global_cap_then_waiting() -> None:
    limiter = FairLimiter(capacity=2, queue_limit=10)
    a = await limiter.acquire("t")
    b = await limiter.acquire("u")
    rec = Recorder(limiter)
    await rec.start("c", "t")
    assert rec.order == [] and limiter.num_waiting == 1
    a.release()
    await settle()
    assert rec.order == ["c"] and limiter.num_running == 2
    b.release()
    rec.slots["c"].release()
    assert limiter.num_running == 0 and limiter.num_waiting == 0


async def test_a_tenant_at_its_cap_waits_while_others_run() -> None:
    limiter = FairLimiter(capacity=4, queue_limit=10)
    held = await limiter.acquire("a", cap=1)
    rec = Recorder(limiter)
    await rec.start("a2", "a", cap=1)
    await rec.start("b1", "b", cap=1)
    assert rec.order == ["b1"]  # the global cap has room; tenant a's own cap holds a2 back
    assert limiter.running_of("a") == 1 and limiter.waiting_of("a") == 1
    held.release()
    await settle()
    assert rec.order == ["b1", "a2"]


async def test_equal_weights_take_turns_whatever_the_arrival_order() -> None:
    limiter = FairLimiter(capacity=1, queue_limit=100)
    holder = await limiter.acquire("h")
    rec = Recorder(limiter)
    for name in ["a1", "a2", "a3", "a4"]:
        await rec.start(name, "a")
    for name in ["b1", "b2"]:
        await rec.start(name, "b")
    await rec.start("c1", "c")
    holder.release()
    await settle()
    await rec.drain()
    assert rec.order == ["a1", "b1", "c1", "a2", "b2", "a3", "a4"]


async def test_a_higher_class_waiter_goes_first_then_tenants_take_turns_within_a_class() -> None:
    limiter = FairLimiter(capacity=1, queue_limit=100)
    holder = await limiter.acquire("h")
    rec = Recorder(limiter)
    for name, tenant, klass in [
        ("a-low1", "a", 1), ("a-low2", "a", 1), ("b-low", "b", 1), ("a-normal", "a", 0),
        ("b-high", "b", -1), ("c-normal", "c", 0),
    ]:  # fmt: skip
        await rec.start(name, tenant, priority=klass)
    holder.release()
    await settle()
    await rec.drain()
    assert rec.order == ["b-high", "a-normal", "c-normal", "a-low1", "b-low", "a-low2"]


async def test_a_full_queue_pushes_out_a_tenants_lowest_class_waiter_first() -> None:
    limiter = FairLimiter(capacity=1, queue_limit=3)
    holder = await limiter.acquire("h")
    rec = Recorder(limiter)
    await rec.start("a-normal", "a", priority=0)
    await rec.start("a-low", "a", priority=1)
    await rec.start("a-high", "a", priority=-1)
    await rec.start("b", "b")  # a holds the whole queue: its newest lowest-class waiter goes
    with pytest.raises(OverloadedError):
        await rec.tasks["a-low"]
    holder.release()
    await settle()
    del rec.tasks["a-low"]
    await rec.drain()
    assert rec.order == ["a-high", "b", "a-normal"]  # within the normal class: b's turn after a's grant


async def test_a_full_queue_never_pushes_out_a_higher_class_than_the_arrival() -> None:
    limiter = FairLimiter(capacity=1, queue_limit=3)
    holder = await limiter.acquire("h")
    rec = Recorder(limiter)
    for i in range(3):
        await rec.start(f"b-high{i}", "b", priority=-1)  # b holds the whole queue, in the high class
    with pytest.raises(OverloadedError):  # a low arrival is refused rather than push a high waiter out
        await limiter.acquire("a", priority=1)
    assert not any(t.done() for t in rec.tasks.values())
    holder.release()
    await settle()
    await rec.drain()
    assert rec.order == ["b-high0", "b-high1", "b-high2"]


async def test_weights_share_slots_in_proportion() -> None:
    limiter = FairLimiter(capacity=1, queue_limit=100)
    holder = await limiter.acquire("h")
    rec = Recorder(limiter)
    for i in range(8):
        await rec.start(f"a{i}", "a", weight=2)
    for i in range(8):
        await rec.start(f"b{i}", "b", weight=1)
    holder.release()
    await settle()
    await rec.drain()
    first_nine = rec.order[:9]
    assert sum(name.startswith("a") for name in first_nine) == 6  # two for a per one for b
    assert [n for n in rec.order if n.startswith("a")] == [f"a{i}" for i in range(8)]  # FIFO per tenant


async def test_an_idle_tenant_banks_no_credit() -> None:
    """Tenant a ran alone for a long time; b arriving now does not get a run of its own turns."""
    limiter = FairLimiter(capacity=1, queue_limit=100)
    for _ in range(20):
        (await limiter.acquire("a")).release()
    holder = await limiter.acquire("a")
    rec = Recorder(limiter)
    for name in ["a1", "a2"]:
        await rec.start(name, "a")
    for name in ["b1", "b2"]:
        await rec.start(name, "b")
    holder.release()
    await settle()
    await rec.drain()
    assert rec.order == ["b1", "a1", "b2", "a2"]


async def test_a_full_queue_refuses_the_arrival() -> None:
    metrics = LimitsMetrics()
    limiter = FairLimiter(capacity=1, queue_limit=2, metrics=metrics)
    holder = await limiter.acquire("a")
    rec = Recorder(limiter)
    await rec.start("a1", "a")
    await rec.start("a2", "a")
    with pytest.raises(OverloadedError) as caught:
        await limiter.acquire("a")
    assert caught.value.reason == "queue_full"
    assert caught.value.wire_error().status == 503
    assert caught.value.wire_error().anthropic_status == 529
    assert caught.value.headers["Retry-After"] == "1"
    assert metrics.rejections.labels(tenant="a", reason="queue_full")._value.get() == 1
    assert gauge(metrics.queued) == 2 and gauge(metrics.running) == 1
    holder.release()
    await settle()
    await rec.drain()
    assert limiter.num_running == 0 and limiter.num_waiting == 0


async def test_a_full_queue_pushes_out_the_tenant_holding_most_of_it() -> None:
    metrics = LimitsMetrics()
    limiter = FairLimiter(capacity=1, queue_limit=3, metrics=metrics)
    holder = await limiter.acquire("flood")
    rec = Recorder(limiter)
    for name in ["f1", "f2", "f3"]:
        await rec.start(name, "flood")
    await rec.start("q1", "quiet")  # the queue is full, but "flood" holds all of it
    with pytest.raises(OverloadedError) as caught:
        await rec.tasks["f3"]  # its newest waiter made room
    assert caught.value.reason == "queue_pushed_out"
    assert limiter.waiting_of("quiet") == 1 and limiter.waiting_of("flood") == 2
    with pytest.raises(OverloadedError):  # now flood holds 2 of 3 and quiet 1: a fair split for another
        await limiter.acquire("flood")
    assert metrics.rejections.labels(tenant="flood", reason="queue_pushed_out")._value.get() == 1
    holder.release()
    await settle()
    assert rec.order[0] == "q1"  # its turn comes first: flood has had the slot
    rec.tasks.pop("f3")
    await rec.drain()


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    limiter = FairLimiter(capacity=1, queue_limit=10)
    holder = await limiter.acquire("a")
    rec = Recorder(limiter)
    await rec.start("b1", "b")
    await rec.start("c1", "c")
    rec.tasks["b1"].cancel()
    await settle()
    assert limiter.num_waiting == 1 and limiter.waiting_of("b") == 0
    holder.release()
    await settle()
    assert rec.order == ["c1"]
    rec.slots["c1"].release()
    assert limiter.num_running == 0 and limiter.num_waiting == 0


async def test_a_slot_granted_to_a_waiter_cancelled_in_the_same_instant_passes_on() -> None:
    limiter = FairLimiter(capacity=1, queue_limit=10)
    holder = await limiter.acquire("a")
    rec = Recorder(limiter)
    await rec.start("b1", "b")
    await rec.start("c1", "c")
    holder.release()  # grants b1 (its future resolves) ...
    rec.tasks["b1"].cancel()  # ... but b1 is cancelled before it runs again
    await settle()
    assert rec.order == ["c1"]
    assert limiter.num_running == 1 and limiter.running_of("b") == 0
    rec.slots["c1"].release()
    assert limiter.num_running == 0


async def test_waiting_past_the_deadline_is_refused() -> None:
    metrics = LimitsMetrics()
    limiter = FairLimiter(capacity=1, queue_limit=10, metrics=metrics)
    holder = await limiter.acquire("a")
    with pytest.raises(OverloadedError) as caught:
        await limiter.acquire("b", timeout_s=0.05)
    assert caught.value.reason == "queue_timeout"
    assert limiter.num_waiting == 0
    assert metrics.rejections.labels(tenant="b", reason="queue_timeout")._value.get() == 1
    holder.release()
    assert limiter.num_running == 0


async def test_release_is_idempotent_and_the_wait_is_reported() -> None:
    limiter = FairLimiter(capacity=1, queue_limit=10)
    first = await limiter.acquire("a")
    assert first.waited_s is None
    waiter = asyncio.create_task(limiter.acquire("a"))
    async with asyncio.timeout(5):
        while limiter.num_waiting == 0:  # until the waiter is queued
            await asyncio.sleep(0)
    await asyncio.sleep(0.02)  # the wait to be reported (at least this long)
    first.release()
    first.release()
    second = await waiter
    assert second.waited_s is not None and second.waited_s >= 0.01
    assert limiter.num_running == 1
    second.release()
    assert limiter.num_running == 0


async def test_a_waiter_cancelled_just_before_a_slot_frees_is_skipped() -> None:
    """Cancelling a task cancels its future at once, but its cleanup runs a loop turn later: a slot
    freed in between goes to the next live waiter."""
    limiter = FairLimiter(capacity=1, queue_limit=10)
    holder = await limiter.acquire("a")
    rec = Recorder(limiter)
    await rec.start("b1", "b")
    await rec.start("c1", "c")
    rec.tasks["b1"].cancel()
    holder.release()
    await settle()
    assert rec.order == ["c1"]
    assert limiter.num_waiting == 0 and limiter.num_running == 1
    rec.slots["c1"].release()
    assert limiter.num_running == 0


async def test_a_cancelled_waiter_frees_its_place_in_a_full_queue() -> None:
    limiter = FairLimiter(capacity=1, queue_limit=2)
    holder = await limiter.acquire("flood")
    rec = Recorder(limiter)
    await rec.start("f1", "flood")
    await rec.start("f2", "flood")
    rec.tasks["f2"].cancel()
    await rec.start("q1", "quiet")  # makes room by taking out f2, already cancelled
    await settle()
    assert limiter.num_waiting == 2 and limiter.waiting_of("quiet") == 1
    holder.release()
    await settle()
    rec.tasks.pop("f2")
    await rec.drain()
    assert limiter.num_running == 0 and limiter.num_waiting == 0
