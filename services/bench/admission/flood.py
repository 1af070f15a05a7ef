"""The traffic and the readings of `kvrelay bench admission`: the other tenant's timed probes, the
flooder's bounded burst, and the stack's end state (codec metrics and connections, the worker's load).

TTFT here is the time to the first SSE event (the codec sends it once the first token exists).
Percentiles interpolate linearly (services/bench/stats.py) and are reported in ms.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import psutil

from services.bench.spawn import UpStack
from services.bench.stats import percentile
from services.common.local_stack import INTERNAL_HOST
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

PROBE = [{"role": "user", "content": "Name three colours."}]
FLOOD = [{"role": "user", "content": "Write a short sentence about the sea."}]
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class FloodPlan:
    """`total` flooder requests spread over `seconds`, at most `concurrency` in flight, each prompt
    padded by `padding` words; `probes` requests of the other tenant per phase."""

    total: int
    seconds: float
    concurrency: int
    padding: int
    probes: int
    max_tokens: int


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


async def streamed(
    client: httpx.AsyncClient, key: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[int, float | None]:
    """(status, seconds to the first SSE event) of one streamed chat request."""
    body = {"model": "flood", "messages": messages, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    ttft: float | None = None
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        async for line in response.aiter_lines():
            if line.startswith("data: ") and ttft is None:
                ttft = time.perf_counter() - started
            if '"error"' in line:
                return 500, ttft
    return 200, ttft


async def probes(url: str, key: str, count: int, max_tokens: int) -> dict[str, Any]:
    """`count` streamed requests one after another: TTFT p50/p99/mean (ms) and the errors."""
    ttfts: list[float] = []
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        for _ in range(count):
            try:
                status, ttft = await streamed(client, key, PROBE, max_tokens)
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)
                continue
            if status != 200 or ttft is None:
                errors.append(str(status))
            else:
                ttfts.append(ttft)
    return {
        "requests": count,
        "errors": errors,
        "ttft_p50_ms": _ms(percentile(ttfts, 50)),
        "ttft_p99_ms": _ms(percentile(ttfts, 99)),
        "ttft_mean_ms": _ms(statistics.fmean(ttfts)) if ttfts else None,
    }


async def flood(url: str, key: str, plan: FloodPlan) -> dict[str, Any]:
    """The flooder's requests (not streamed), one every `seconds / total` s: statuses and Retry-After."""
    messages = [{"role": "user", "content": FLOOD[0]["content"] + " sea" * plan.padding}]
    body = {"model": "flood", "messages": messages, "max_tokens": plan.max_tokens}
    statuses: dict[str, int] = {}
    retry_after: list[int] = []
    gate = asyncio.Semaphore(plan.concurrency)
    limits = httpx.Limits(max_connections=plan.concurrency)
    async with httpx.AsyncClient(
        base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False
    ) as client:

        async def one(delay: float) -> None:
            await asyncio.sleep(delay)
            async with gate:
                try:
                    r = await client.post(
                        "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
                    )
                    status = str(r.status_code)
                    if r.status_code == 429:
                        retry_after.append(int(r.headers["retry-after"]))
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                statuses[status] = statuses.get(status, 0) + 1

        await asyncio.gather(*(one(i * plan.seconds / plan.total) for i in range(plan.total)))
    return {
        "sent": plan.total,
        "statuses": statuses,
        "retry_after_s_min_max": [min(retry_after), max(retry_after)] if retry_after else None,
    }


async def measure(url: str, keys: dict[str, str], plan: FloodPlan) -> dict[str, Any]:
    """Warm-up, the other tenant unloaded, then again while the flood runs."""
    await probes(url, keys["other"], 2, plan.max_tokens)
    unloaded = await probes(url, keys["other"], plan.probes, plan.max_tokens)
    flood_task = asyncio.create_task(flood(url, keys["flooder"], plan))
    await asyncio.sleep(min(2.0, plan.seconds / 4))  # let the flood build up first
    loaded = await probes(url, keys["other"], plan.probes, plan.max_tokens)
    flooded = await flood_task
    return {"unloaded": unloaded, "loaded": loaded, "flooder": flooded}


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def token_gaps(text: str) -> dict[str, float]:
    """How many gaps between two tokens of one request were over 0.5, 1 and 2.5 s (codec histogram)."""
    name = "kvrelay_inter_token_latency_seconds_bucket"
    pattern = rf'^{name}{{le="([^"]+)"}} (\S+)$'
    buckets = {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}
    total = buckets.get("+Inf", 0.0)
    return {
        "gaps": total,
        "over_0_5_s": total - buckets.get("0.5", total),
        "over_1_s": total - buckets.get("1.0", total),
        "over_2_5_s": total - buckets.get("2.5", total),
    }


@dataclass(frozen=True)
class Readings:
    """Where the end state is read: the codec's URL, PID and port, the worker's address, the token."""

    url: str
    codec_pid: int
    codec_port: int
    worker: str
    token: str


def end_state(at: Readings) -> dict[str, Any]:
    """Codec admission and quota gauges, its client connections, the worker's load, step timeouts."""
    text = httpx.get(f"{at.url}/metrics", timeout=5.0, trust_env=False).text
    connections = [
        c
        for c in psutil.Process(at.codec_pid).net_connections(kind="tcp")
        if c.laddr and c.laddr.port == at.codec_port and c.status == psutil.CONN_ESTABLISHED
    ]
    with grpc.insecure_channel(at.worker, options=[("grpc.enable_http_proxy", 0)]) as channel:
        load = worker_pb2_grpc.WorkerStub(channel).Load(
            pb.LoadRequest(), metadata=(("authorization", f"Bearer {at.token}"),), timeout=5.0
        )
    return {
        "codec_running": metric(text, "kvrelay_admission_running"),
        "codec_queued": metric(text, "kvrelay_admission_queued"),
        "quota_open_reservations": metric(text, "kvrelay_quota_open_reservations"),
        "quota_reserved_tokens": metric(text, "kvrelay_quota_reserved_tokens"),
        "codec_client_connections": len(connections),
        "worker_running": load.running,
        "worker_waiting": load.waiting,
        "worker_kv_blocks_active": load.kv_blocks.active,
        "step_timeouts": metric(text, "kvrelay_step_timeouts_total"),
        "token_gaps": token_gaps(text),
    }


def settled(state: dict[str, Any]) -> bool:
    return all(state[k] == 0 for k in state if k not in ("step_timeouts", "token_gaps"))


def readings(stack: UpStack) -> Readings:
    """Where `stack`'s end state is read (its first worker's)."""
    ports = stack.plan.ports
    worker = f"{INTERNAL_HOST}:{ports.workers[0]}"
    return Readings(stack.url, stack.services.pids()["codec"], ports.codec, worker, stack.token)


def wait_settled(at: Readings, within_s: float) -> dict[str, Any]:
    """The end state once it is all zero, or as it is after `within_s` (connections close asynchronously
    once the clients are done)."""
    state = end_state(at)
    deadline = time.monotonic() + within_s
    while not settled(state) and time.monotonic() < deadline:
        time.sleep(0.5)
        state = end_state(at)
    return state
