"""The load of `kvrelay bench serve`: arrivals, the count and time bounds, the progress bar, settling.

Arrivals are of jobs (workload.py): a multi-turn job's follow-ups go out as soon as the
previous reply ends. `poisson`: exponential gaps at `rate` jobs/s; `burst`: `burst_size` jobs at once,
bursts at exponential gaps of mean `burst_size / rate` s (the same mean rate); `closed`: `concurrency`
clients, each sending its next job when the last one ends; `at-once`: every job at time 0 (the
cancellation burst).

Bounds: no job starts once `num_requests` requests are taken (a job takes all its turns as it starts,
as many as are left) or `duration_s` has passed; requests still
running at `duration_s + drain_s` are cancelled and recorded as `timeout`. So a run ends by itself.

Settling (`check_settled`): on a kvrelay stack (GET /status answers a `services` list), poll until every
service shows no running request and no active KV block, on polls at least SETTLE_HOLD_S apart (the
workers' load reports lag about a second), within a timeout.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
from tqdm import tqdm

from services.bench.serve.clients import RequestRecord, SendOptions, stream
from services.bench.serve.workload import Job

ARRIVALS = ("poisson", "burst", "closed")
SETTLE_HOLD_S = 1.5
SETTLE_POLL_S = 0.25


@dataclass(frozen=True)
class LoadPlan:
    arrival: str = "poisson"  # one of ARRIVALS, or "at-once"
    rate: float = 1.0
    concurrency: int = 4
    burst_size: int = 4
    num_requests: int = 32
    duration_s: float = 120.0
    drain_s: float = 60.0
    seed: int = 0


def arrival_times(plan: LoadPlan) -> Iterator[float]:
    """Seconds from the start at which each job arrives (open loop)."""
    rng = random.Random(plan.seed + 7919)
    at = 0.0
    for i in range(plan.num_requests):
        if plan.arrival == "poisson" and i:
            at += rng.expovariate(plan.rate)
        elif plan.arrival == "burst" and i and i % plan.burst_size == 0:
            at += rng.expovariate(plan.rate / plan.burst_size)
        yield at


class Budget:
    """Counts started requests against the two bounds."""

    def __init__(self, plan: LoadPlan, t0: float) -> None:
        self.plan, self.t0, self.started = plan, t0, 0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def exhausted(self) -> bool:
        return self.started >= self.plan.num_requests or self.elapsed() >= self.plan.duration_s

    def take(self, wanted: int) -> int:
        """Up to `wanted` requests from what is left: a job reserves all its turns when it starts, so
        which requests go out depends on the arrival order alone, never on how fast replies come."""
        granted = 0 if self.exhausted() else min(wanted, self.plan.num_requests - self.started)
        self.started += granted
        return granted


class Runner:
    """One run: jobs out under the plan's arrivals and bounds, a record per request."""

    def __init__(self, client: httpx.AsyncClient, opts: SendOptions, plan: LoadPlan, keys: dict[str, str]):
        self.client, self.opts, self.plan, self.keys = client, opts, plan, keys
        self.records: list[RequestRecord] = []
        self.t0 = time.perf_counter()
        self.budget = Budget(plan, self.t0)
        self.progress: Any = None

    async def run_job(self, job: Job) -> None:
        messages: list[dict[str, str]] = []
        opts = replace(self.opts, api_key=self.keys.get(job.tenant, self.opts.api_key))
        for turn, text in enumerate(job.turns[: self.budget.take(len(job.turns))]):
            messages.append({"role": "user", "content": text})
            start = time.perf_counter() - self.t0
            record = RequestRecord(job.index, turn, job.kind, job.protocol, job.tenant, start)
            self.records.append(record)
            await stream(self.client, record, job.system, list(messages), opts, job.cancel_after_first_delta)
            self.progress.update(1)
            if record.status != "ok":
                return
            messages.append({"role": "assistant", "content": record.text})

    async def _open_loop(self, jobs: list[Job]) -> list[asyncio.Task[None]]:
        tasks = []
        for job, at in zip(jobs, arrival_times(self.plan), strict=False):
            if at >= self.plan.duration_s or self.budget.exhausted():
                break
            await asyncio.sleep(max(0.0, at - self.budget.elapsed()))
            tasks.append(asyncio.create_task(self.run_job(job)))
        return tasks

    async def _closed_client(self, jobs: Iterator[Job]) -> None:
        for job in jobs:
            if self.budget.exhausted():
                return
            await self.run_job(job)

    async def run(
        self, jobs: list[Job], label: str, show_progress: bool
    ) -> tuple[list[RequestRecord], float]:
        """Every record and the wall time (first request out to last one done)."""
        self.t0 = self.budget.t0 = time.perf_counter()
        with tqdm(
            total=self.plan.num_requests, desc=label, unit="req", file=sys.stderr, disable=not show_progress
        ) as bar:
            self.progress = bar
            if self.plan.arrival == "closed":
                shared = iter(jobs)
                tasks = [
                    asyncio.create_task(self._closed_client(shared)) for _ in range(self.plan.concurrency)
                ]
            else:
                tasks = await self._open_loop(jobs)
            await self._bounded_wait(tasks)
        for record in self.records:
            if record.status == "in_flight":
                record.status, record.error = "timeout", "still running at the duration bound"
        return self.records, self._wall()

    async def _bounded_wait(self, tasks: list[asyncio.Task[None]]) -> None:
        left = self.plan.duration_s + self.plan.drain_s - self.budget.elapsed()
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, left))
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _wall(self) -> float:
        ends = [r.start_s + (r.e2e_s or 0.0) for r in self.records]
        starts = [r.start_s for r in self.records]
        return max(ends) - min(starts) if self.records else 0.0


def _idle(services: list[dict[str, Any]]) -> tuple[bool, dict[str, int]]:
    running = sum(int(s.get("running") or 0) for s in services)
    active = sum(int((s.get("kv_blocks") or {}).get("active") or 0) for s in services)
    return running == 0 and active == 0, {"running": running, "kv_active_blocks": active}


async def _status_services(client: httpx.AsyncClient, headers: dict[str, str]) -> list[dict[str, Any]] | None:
    try:
        response = await client.get("/status", headers=headers, timeout=5.0)
        document = response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
    services = document.get("services") if isinstance(document, dict) else None
    return services if isinstance(services, list) else None


async def check_settled(
    client: httpx.AsyncClient, timeout_s: float, headers: dict[str, str]
) -> dict[str, Any]:
    """Whether a kvrelay stack went back to idle (no running request, no active KV block) in time."""
    t0 = time.perf_counter()
    services = await _status_services(client, headers)
    if services is None:
        return {"checked": False, "reason": "GET /status gave no kvrelay status document (not our stack?)"}
    idle_since: float | None = None
    while True:
        now = time.perf_counter() - t0
        idle, seen = _idle(services)
        idle_since = (idle_since if idle_since is not None else now) if idle else None
        if idle_since is not None and now - idle_since >= SETTLE_HOLD_S:
            return {"checked": True, "settled": True, "settle_s": round(idle_since, 3), "last": seen}
        if now > timeout_s:
            return {"checked": True, "settled": False, "settle_s": None, "last": seen}
        await asyncio.sleep(SETTLE_POLL_S)
        services = await _status_services(client, headers) or services
