"""`kvrelay bench serve`: a load generator for any OpenAI- or Anthropic-compatible server on loopback (or,
with --allow-remote and an API key, a deployment).

Drives `--url` (ours or a peer's, 127.0.0.0/8, localhost or [::1] only) with a seeded workload
(workload.py) over streaming HTTP in one or all four protocols (clients.py), under Poisson, bursty or
closed-loop arrivals (load.py), bounded by `--num-requests` and `--duration`. Reports TTFT, TPOT, ITL
and e2e at p50/p90/p99, throughput, goodput under `--slo-*` and the prefix hit rate (summary.py), as a
table, `--json` and `--plot` PNGs (report.py).
On a kvrelay stack it then checks the stack settles: no running request, no active KV block.

`--sweep 0.5,1,2` runs the same workload once per load (rates, or concurrencies with `--arrival closed`),
one after another, each with the same bounds, for the throughput-against-load plot, and reports where
latency broke the SLO, where throughput stopped following the load and which stage's queue grew first,
read from the stack's own /status and /metrics while each load ran (stages.py).
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from services.bench.serve.clients import SendOptions
from services.bench.serve.load import ARRIVALS, LoadPlan, Runner, check_settled
from services.bench.serve.report import HEADER, load_plot_path, plot_cdfs, plot_load, table_rows
from services.bench.serve.stages import StageSampler, report_lines, sweep_report
from services.bench.serve.summary import Slo, run_summary
from services.bench.serve.workload import PROTOCOLS, WORKLOADS, WorkloadPlan, build_jobs
from services.bench.tables import format_table

LOOPBACK_NAMES = ("localhost", "localhost.")
MAX_SWEEP_POINTS = 8


class NotLoopbackError(SystemExit):
    """--url names a host off this machine."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="load generator for an OpenAI/Anthropic-compatible server on loopback")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="loopback, unless --allow-remote")
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="let --url name a deployment off this machine (load against it needs --api-key)",
    )
    p.add_argument("--protocol", choices=[*PROTOCOLS, "mix"], default="openai-chat")
    p.add_argument("--workload", choices=WORKLOADS, default="mix")
    p.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    p.add_argument("--rate", type=float, default=1.0, help="jobs/s for poisson and burst arrivals")
    p.add_argument("--concurrency", type=int, default=4, help="clients for closed-loop arrivals")
    p.add_argument("--burst-size", type=int, default=4, help="jobs per burst (burst arrivals)")
    p.add_argument("--num-requests", type=int, default=32, help="at most this many requests start")
    p.add_argument("--duration", type=float, default=120.0, help="no request starts after this many s")
    p.add_argument("--drain", type=float, default=60.0, help="s past --duration before cancelling the rest")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (chat and completions only)")
    p.add_argument("--doc-sentences", type=int, default=24, help="length of summary documents")
    p.add_argument("--turns", type=int, default=3, help="turns of a multi-turn job")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--api-key", default=None, help="sent as Bearer (OpenAI) or x-api-key (Anthropic)")
    p.add_argument("--tenant-keys", default=None, help="A,B: one key per tenant (two-tenants workload)")
    p.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sweep", default=None, help="comma-separated loads (rates; concurrencies if closed)")
    p.add_argument("--settle-timeout", type=float, default=30.0, help="s to wait for a kvrelay stack to idle")
    p.add_argument("--label", default=None, help="a name for this run in the JSON (e.g. the server)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write latency CDFs here (PNG)")
    p.set_defaults(handler=run)


def require_loopback(url: str, *, allow_remote: bool = False, api_key: str | None = None) -> str:
    """`url` without a trailing slash if its host is a loopback address (or any host, with `allow_remote`
    and an API key: load against a deployment is an operator's explicit act), else a clear refusal."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    try:
        loopback = host in LOOPBACK_NAMES or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parts.scheme in ("http", "https") and not loopback and allow_remote:
        if not api_key:
            raise NotLoopbackError(
                f"kvrelay bench serve: refusing --url {url!r} with --allow-remote and no --api-key: a "
                "deployment's load is sent as one of its tenants"
            )
        return url.rstrip("/")
    if parts.scheme not in ("http", "https") or not loopback:
        raise NotLoopbackError(
            f"kvrelay bench serve: refusing --url {url!r}: it only sends load to this machine's loopback "
            "(http://127.0.0.0/8, http://localhost or http://[::1]); --allow-remote with --api-key for a "
            "deployment"
        )
    return url.rstrip("/")


def _positive(args: argparse.Namespace) -> None:
    numbers = ("rate", "concurrency", "burst_size", "num_requests", "duration", "max_tokens", "turns")
    bad = [f"--{n.replace('_', '-')}" for n in numbers if getattr(args, n) <= 0]
    if bad or args.drain < 0 or args.doc_sentences < 1:
        raise SystemExit(f"kvrelay bench serve: {', '.join(bad) or '--drain/--doc-sentences'} out of range")


def _keys(args: argparse.Namespace) -> dict[str, str]:
    """API key per tenant label (t0, t1, ...) of --tenant-keys; other jobs send --api-key, if any."""
    if not args.tenant_keys:
        return {}
    keys = [k.strip() for k in args.tenant_keys.split(",") if k.strip()]
    if len(keys) < 2:
        raise SystemExit("kvrelay bench serve: --tenant-keys takes at least two comma-separated keys")
    return {f"t{i}": key for i, key in enumerate(keys)}


def _loads(args: argparse.Namespace) -> list[float]:
    if not args.sweep:
        return [float(args.concurrency if args.arrival == "closed" else args.rate)]
    try:
        loads = [float(x) for x in args.sweep.split(",") if x.strip()]
    except ValueError:
        raise SystemExit("kvrelay bench serve: --sweep takes comma-separated numbers") from None
    if not loads or len(loads) > MAX_SWEEP_POINTS or min(loads) <= 0:
        raise SystemExit(f"kvrelay bench serve: --sweep takes 1 to {MAX_SWEEP_POINTS} positive loads")
    return sorted(loads)  # the report reads the loads as steps up


def _load_plan(args: argparse.Namespace, load: float) -> LoadPlan:
    closed = args.arrival == "closed"
    return LoadPlan(
        arrival="at-once" if args.workload == "cancel-burst" else args.arrival,
        rate=args.rate if closed else load,
        concurrency=max(1, round(load)) if closed else args.concurrency,
        burst_size=args.burst_size,
        num_requests=args.num_requests,
        duration_s=args.duration,
        drain_s=args.drain,
        seed=args.seed,
    )


async def _model(client: httpx.AsyncClient, headers: dict[str, str]) -> str:
    response = await client.get("/v1/models", headers=headers)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


async def _measure(args: argparse.Namespace, url: str, loads: list[float]) -> dict[str, Any]:
    keys = _keys(args)
    first_key = next(iter(keys.values()), args.api_key)
    auth = {"authorization": f"Bearer {first_key}"} if first_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    timeout = httpx.Timeout(args.duration + args.drain + 30, connect=10.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False) as client:
        model = args.model or await _model(client, auth)
        result = _header(args, url, model)
        opts = SendOptions(model, args.max_tokens, args.api_key, args.ignore_eos)
        workload = WorkloadPlan(
            args.workload, args.protocol, args.doc_sentences, args.turns, len(keys) or 1, args.seed
        )
        jobs = build_jobs(workload, args.num_requests)
        for load in loads:
            runner = Runner(client, opts, _load_plan(args, load), keys)
            sampler, stop = StageSampler(client, auth), asyncio.Event()
            sampling = asyncio.create_task(sampler.run(stop))
            try:
                records, wall = await runner.run(jobs, f"load {load:g}", not args.no_progress)
            finally:
                stop.set()
                await sampling
            run = {"load": f"{load:g}", **run_summary(records, wall, Slo(args.slo_ttft_ms, args.slo_tpot_ms))}
            run["stages"], run["stage_sources"] = sampler.summary(), sorted(sampler.sources)
            run["settle"] = await check_settled(client, args.settle_timeout, auth)
            run["requests"] = [r.as_json() for r in records]
            result["runs"].append(run)
    return result


def _header(args: argparse.Namespace, url: str, model: str) -> dict[str, Any]:
    return {
        "label": args.label,
        "url": url,
        "model": model,
        "protocol": args.protocol,
        "workload": args.workload,
        "arrival": "at-once" if args.workload == "cancel-burst" else args.arrival,
        "rate": args.rate,
        "concurrency": args.concurrency,
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "max_tokens": args.max_tokens,
        "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms},
        "seed": args.seed,
        "tenant_keys": len(_keys(args)),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "runs": [],
    }


def _settle_line(run: dict[str, Any]) -> str:
    settle = run["settle"]
    if not settle["checked"]:
        return f"load {run['load']}: settle not checked ({settle['reason']})"
    if settle["settled"]:
        return f"load {run['load']}: settled in {settle['settle_s']:.2f} s (no running request, no active KV)"
    return f"load {run['load']}: NOT settled in time, last seen {settle['last']}"


def run(args: argparse.Namespace) -> int:
    url = require_loopback(args.url, allow_remote=args.allow_remote, api_key=args.api_key)
    _positive(args)
    loads = _loads(args)
    try:
        result = asyncio.run(_measure(args, url, loads))
    except (httpx.HTTPError, ValueError, LookupError) as exc:  # only GET /v1/models raises: no model to use
        print(f"kvrelay bench serve: {url} did not list a model (GET /v1/models): {exc}", file=sys.stderr)
        return 1
    print(
        f"{result['workload']} workload, {result['protocol']} protocol, {result['arrival']} arrivals, "
        f"model {result['model']}, SLO TTFT {args.slo_ttft_ms:g} ms / TPOT {args.slo_tpot_ms:g} ms"
    )
    print(format_table(HEADER, table_rows(result)))
    for run_result in result["runs"]:
        print(_settle_line(run_result))
    if len(result["runs"]) > 1:
        result["sweep_report"] = sweep_report(result)
        print("\n".join(report_lines(result["sweep_report"])))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot_cdfs(result, args.plot)
        if len(result["runs"]) > 1:
            plot_load(result, load_plot_path(args.plot))
    return 0
