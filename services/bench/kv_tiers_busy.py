"""`kvrelay bench kv-tiers --scenario busy`: returning sessions whose replica is busy, with the router's
tier-aware scoring on and off (`router.tier_aware`), side by side in one run.

Per side (`aware`, `unaware`; one stack at a time): `kvrelay up --workers 2` with a shared tier (a cache
Redis of its own on a free port), the cost policy, sessions keyed by `x-session-id` (so each keeps a home
replica) and `limits.batch_size_limit` small enough that a hog queues:
- warm: turns 0 .. turns-2, every session at once per turn; then the tier writes settle on both workers;
- busy: worker-0 gets a hog sent to it directly (not through the router: `--hog` requests of
  `--hog-tokens` greedy tokens each, more than its batch holds, so some wait), then the last turn.

With tier-aware scoring the router sees each busy-homed session's prefix one fetch away on worker-1 and
sends it there (`session_moved`); without, the session stays home and waits behind the hog. Reported per
side and phase: TTFT p50/p99, the prefix hit rate, the prompt tokens loaded from the tiers, and the busy
turn's requests the router sent off their busy home (`session_moved`, from its log). No timing is
asserted anywhere; this reports.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import grpc
import yaml

from services.bench.kv_tiers_phases import (
    POLL_S,
    WAIT_S,
    Workers,
    run_phase,
    sessions,
    wait_ready,
    wait_writes_settled,
)
from services.bench.routing.workload import REQUEST_TIMEOUT_S, WorkloadPlan
from services.bench.spawn import SupervisedStack, UpSettings, interrupted_by, up_plan, up_specs
from services.common.cache_redis import start_cache_redis, stop_cache_redis
from services.common.local_stack import INTERNAL_HOST, TOKEN_ENV, free_ports, public_url
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.common.status_client import fetch_status
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

SIDES = ("aware", "unaware")
BUSY = "worker-0"


def measure_all(args: argparse.Namespace, plan: WorkloadPlan, logs: Path) -> dict[str, Any]:
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or set(sides) - set(SIDES):
        raise SystemExit(f"--scenario busy takes --sides of {', '.join(SIDES)}")
    with interrupted_by(signal.SIGTERM):
        return {side: _measure(side, args, plan, logs / side) for side in sides}


def _config(side: str, args: argparse.Namespace, logs: Path, cache_port: int) -> Path:
    config = {
        "engine": {"kv_cache_memory_mb": args.kv_cache_mb, "max_model_len": args.max_model_len},
        "limits": {"batch_size_limit": args.batch_size},
        "router": {"policy": "cost", "tier_aware": side == "aware"},
        "kv_tiers": {
            "segment_tokens": args.segment_tokens,
            "shared_url": f"redis://127.0.0.1:{cache_port}/0",
        },
    }
    path = logs / "bench-config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _measure(side: str, args: argparse.Namespace, plan: WorkloadPlan, logs: Path) -> dict[str, Any]:
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as cleanup:
        cache_port = free_ports(1)[0]
        cache = start_cache_redis(cache_port, maxmemory_mb=1024)
        cleanup.callback(stop_cache_redis, cache)
        plan_ = up_plan(UpSettings(args.model, _config(side, args, logs, cache_port), logs, workers=2))
        stack = SupervisedStack(up_specs(plan_, logs)).start()
        cleanup.callback(stack.stop)
        url = public_url(INTERNAL_HOST, plan_.ports.codec)
        metadata = (("authorization", f"Bearer {plan_.env[TOKEN_ENV]}"),)
        workers = Workers([f"{INTERNAL_HOST}:{port}" for port in plan_.ports.workers], metadata)
        for name in ("worker-0", "worker-1"):
            wait_ready(url, name)
        return asyncio.run(_phases(url, workers, args, plan, logs / "router.log"))


async def _phases(
    url: str, workers: Workers, args: argparse.Namespace, plan: WorkloadPlan, router_log: Path
) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    async with sessions(url, args.model, plan) as (sender, conversations):
        phases["warm"] = await run_phase(workers, sender, conversations, range(plan.turns - 1))
        for name in ("worker-0", "worker-1"):
            wait_writes_settled(url, name)
        hog = asyncio.create_task(_hog(workers.addresses[0], workers.metadata, args))
        try:
            deadline = time.monotonic() + WAIT_S
            while (
                _router_sees_waiting(url, BUSY) == 0
            ):  # the hog runs meanwhile; the router's load is 1 s old
                if hog.done() or time.monotonic() > deadline:
                    raise RuntimeError(f"{BUSY} never queued the hog ({args.hog} requests)")
                await asyncio.sleep(POLL_S)
            phases["busy"] = await run_phase(workers, sender, conversations, [plan.turns - 1])
            phases["busy"]["sessions_moved"] = _sessions_moved(router_log)
        finally:
            hog.cancel()
            await asyncio.gather(hog, return_exceptions=True)
    return phases


async def _hog(address: str, metadata: tuple[tuple[str, str], ...], args: argparse.Namespace) -> None:
    """`args.hog` long greedy generations on one worker, straight to it, until done or cancelled."""
    params = SamplingParams(temperature=0.0, max_tokens=args.hog_tokens, ignore_eos=True)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)

        async def one(index: int) -> None:
            request = pb.GenerateRequest(
                request_id=f"bench-hog-{index}", prompt_token_ids=[1] * 64, sampling=sampling_to_proto(params)
            )
            async for _ in stub.Generate(request, metadata=metadata, timeout=REQUEST_TIMEOUT_S):
                pass

        await asyncio.gather(*(one(i) for i in range(args.hog)))


def _router_sees_waiting(url: str, name: str) -> int:
    """The requests waiting on `name` as the router last saw them (its probe's Load)."""
    (worker,) = [s for s in fetch_status(url)["services"] if s.get("name") == name]
    return int(worker.get("waiting") or 0)


def _sessions_moved(router_log: Path) -> int:
    """Requests the router sent off their session's busy home (its `routed` log lines, written as each
    request ends: every one has by the end of the phase)."""
    return sum('"reason": "session_moved"' in line for line in router_log.read_text().splitlines())
