"""`kvrelay bench kv-tiers`: multi-turn sessions across a worker restart and a rescale from one replica to
two, without the KV tiers and with a shared tier, side by side in one run.

Per side (`--sides`, default off,shared; one stack at a time, never two competing for the CPU): the stack
`kvrelay up --workers 2` plans (two colocated workers, the router over both, the codec), but worker-1 held
back, so the router serves from worker-0 alone; for `shared`, a cache Redis of its own role on a free port
(started as `kvrelay up` starts one, services/common/cache_redis.py) and `kv_tiers.shared_url` naming it.
The router's policy is round_robin: once worker-1 is up, a session's turns alternate between the
replicas, as when a router has to move sessions (the cost policy would keep them where their prefix is;
`kvrelay bench routing` measures that).

The workload is `kvrelay bench routing`'s (seeded conversations over the chat template, streamed to
/v1/completions without a session key), driven turn by turn, every session concurrently within a turn:
- warm: turns 0 .. turns-3 on worker-0 alone;
- restart: once worker-0's tier writes have settled, worker-0 killed (SIGKILL; the supervisor starts it
  again, with an empty pool), then one turn;
- rescale: worker-1 started, then one turn, which round-robin spreads over both.

Per side and phase: TTFT p50/p99 at the client, the prefix hit rate (usage cached_tokens over
prompt_tokens), and the prompt tokens the workers loaded from the tiers (each worker's Load). No timing is
asserted anywhere; this reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import yaml

from services.bench import kv_tiers_busy
from services.bench.kv_tiers_phases import (
    Workers,
    run_phase,
    sessions,
    wait_for,
    wait_ready,
    wait_writes_settled,
)
from services.bench.plots import plot_kv_tiers
from services.bench.routing.workload import (
    WorkloadPlan,
)
from services.bench.spawn import SupervisedStack, UpSettings, interrupted_by, up_plan, up_specs
from services.bench.tables import format_table
from services.common.cache_redis import start_cache_redis, stop_cache_redis
from services.common.local_stack import INTERNAL_HOST, TOKEN_ENV, free_ports, public_url

SIDES = ("off", "shared", "disk")
PHASES = ("warm", "restart", "rescale")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "kv-tiers", help="sessions across a worker restart and a rescale, with and without KV tiers"
    )
    p.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    p.add_argument(
        "--scenario",
        choices=("restart", "busy"),
        default="restart",
        help="restart: a worker restart and a rescale; busy: returning sessions whose replica is busy, with "
        "the router's tier-aware scoring on and off (bench/kv_tiers_busy.py)",
    )
    p.add_argument(
        "--sides",
        default=None,
        help=f"restart: of {','.join(SIDES)} (off,shared); busy: of aware,unaware (both)",
    )
    p.add_argument("--hog", type=int, default=12, help="busy: long requests sent straight to worker-0")
    p.add_argument("--hog-tokens", type=int, default=256, help="busy: greedy tokens per hog request")
    p.add_argument("--batch-size", type=int, default=4, help="busy: limits.batch_size_limit per worker")
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4, help="at least 3: warm turns, then restart and rescale")
    p.add_argument("--system-tokens", type=int, default=300, help="shared system prompt, about")
    p.add_argument("--first-user-tokens", type=int, default=600, help="each session's first message, about")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per turn")
    p.add_argument("--segment-tokens", type=int, default=256, help="kv_tiers.segment_tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-mb", type=int, default=512, help="engine.kv_cache_memory_mb per worker")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--logs", type=Path, default=None, help="stack logs here (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG chart here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    busy = args.scenario == "busy"
    args.sides = args.sides or ("aware,unaware" if busy else "off,shared")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not busy and (not sides or set(sides) - set(SIDES)):
        raise SystemExit(f"--sides takes a comma-separated list of {', '.join(SIDES)}")
    if args.turns < 3 or min(args.sessions, args.max_tokens) < 1:
        raise SystemExit("--turns must be at least 3, --sessions and --max-tokens at least 1")
    plan = WorkloadPlan(
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        first_user_tokens=args.first_user_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
        session="header" if busy else "none",  # busy: sessions keep a home replica
    )
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvrelay-bench-kv-tiers-"))
    logs.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "scenario": args.scenario,
        "model": str(args.model),
        "workload": plan.__dict__,
        "segment_tokens": args.segment_tokens,
        "kv_cache_mb": args.kv_cache_mb,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "logs": str(logs),
        "sides": {},
    }
    if busy:
        result["sides"] = kv_tiers_busy.measure_all(args, plan, logs)
    else:
        with interrupted_by(signal.SIGTERM):
            for side in sides:
                result["sides"][side] = _measure(side, args, plan, logs / side)
    print(format_table(*_table(result)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot_kv_tiers(result, args.plot)
    return 0


def _config(side: str, args: argparse.Namespace, logs: Path, cache_port: int | None) -> Path:
    config: dict[str, Any] = {
        "engine": {"kv_cache_memory_mb": args.kv_cache_mb, "max_model_len": args.max_model_len},
        "router": {"policy": "round_robin"},
    }
    if side != "off":
        tiers: dict[str, Any] = {"segment_tokens": args.segment_tokens}
        if side == "shared":
            tiers["shared_url"] = f"redis://127.0.0.1:{cache_port}/0"
        else:
            tiers["disk_path"] = str(logs / "kv-disk")
        config["kv_tiers"] = tiers
    path = logs / "bench-config.yaml"  # the stack's effective one is config.yaml beside it
    path.write_text(yaml.safe_dump(config))
    return path


def _measure(side: str, args: argparse.Namespace, plan: WorkloadPlan, logs: Path) -> dict[str, Any]:
    """One stack for `side`, through the three phases: per phase its turns' summary and tier counters."""
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as cleanup:
        cache_port = None
        if side == "shared":
            cache_port = free_ports(1)[0]
            cache = start_cache_redis(cache_port, maxmemory_mb=1024)
            cleanup.callback(stop_cache_redis, cache)
        plan_ = up_plan(UpSettings(args.model, _config(side, args, logs, cache_port), logs, workers=2))
        specs = up_specs(plan_, logs)
        held_back = [s for s in specs if s.name == "worker-1"]
        main = SupervisedStack([s for s in specs if s.name != "worker-1"]).start()
        cleanup.callback(main.stop)
        url = public_url(INTERNAL_HOST, plan_.ports.codec)
        metadata = (("authorization", f"Bearer {plan_.env[TOKEN_ENV]}"),)
        workers = Workers([f"{INTERNAL_HOST}:{port}" for port in plan_.ports.workers], metadata)
        return asyncio.run(_phases(url, workers, args.model, plan, main, held_back, cleanup))


async def _phases(url: str, workers: Workers, model: Path, plan: WorkloadPlan, main: SupervisedStack,
                  held_back: list[Any], cleanup: ExitStack) -> dict[str, Any]:  # fmt: skip
    phases: dict[str, Any] = {}
    async with sessions(url, model, plan) as (sender, conversations):
        turns = [conversations[0].first_user, *conversations[0].follow_ups]
        phases["warm"] = await run_phase(workers, sender, conversations, range(len(turns) - 2))
        wait_writes_settled(url, "worker-0")
        _restart(main, "worker-0", url)
        phases["restart"] = await run_phase(workers, sender, conversations, [len(turns) - 2])
        second = SupervisedStack(held_back).start()
        cleanup.callback(second.stop)
        wait_ready(url, "worker-1")
        phases["rescale"] = await run_phase(workers, sender, conversations, [len(turns) - 1])
    return phases


def _restart(stack: SupervisedStack, name: str, url: str) -> None:
    """SIGKILL `name`; its supervisor starts it again; wait until the router uses the new process (ready,
    and its counters start from zero)."""
    old = stack.pids()[name]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: stack.pids().get(name) not in (None, old), f"{name} restarted")
    wait_ready(url, name)


def _table(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    header = ["side", "phase", "requests", "hit rate", "TTFT p50 ms", "TTFT p99 ms", "from tiers", "errors"]
    header += ["sessions moved"] if result.get("scenario") == "busy" else []
    rows = []
    for side, phases in result["sides"].items():
        for phase, summary in phases.items():
            rows.append([
                side, phase, str(summary["requests"]),
                "-" if summary["hit_rate"] is None else f"{summary['hit_rate']:.1%}",
                _ms(summary["ttft_p50_s"]), _ms(summary["ttft_p99_s"]),
                str(summary["tier_fetched_tokens"]), str(len(summary["errors"])),
            ] + ([str(summary.get("sessions_moved", "-"))] if len(header) > 8 else []))  # fmt: skip
    return header, rows


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"
