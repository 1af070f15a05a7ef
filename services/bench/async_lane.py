"""`kvrelay bench async-lane`: interactive TTFT with and without low-class background work beside it.

One `kvrelay up` stack (colocated, one worker) whose codec drains a queue-role Redis of its own on a free
port (queue.url). First the saturation rate: `--saturation-clients` closed-loop streamed chats until
`--saturation-requests` have ended, requests per second. Then `--rounds` rounds, each with two phases of
`--phase-seconds` in turn (the side that goes first alternates), interactive streamed chats arriving as a
Poisson process at `--load-fraction` of the saturation rate:

- alone: nothing else;
- background: a feeder keeps `--backlog` background responses (`service_tier: "flex"`, the low class)
  outstanding, each replaced by a new one as it ends; or, with `--batch-lines N`, one OpenAI batch of N
  chat lines (each line a low-class job, docs/batches.md) created as the phase starts and left to finish
  after the interactive load stops (its store: `--batch-store-url`, a PostgreSQL).

Between phases the background work left is cancelled and the stack settles (no running request, no
queued job). Reported per round and side: the interactive TTFT p50 and p99; the within-round ratio of the
p50s (background / alone) and its median over rounds; the background requests that completed during the
phase over those submitted in it. JSON (`--json`) and a PNG (`--plot`). No timing is asserted anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from services.bench.plots import _grouped_bars, _pyplot, _save
from services.bench.serve.clients import RequestRecord, SendOptions, stream
from services.bench.spawn import UpSettings, interrupted_by, start_up_stack
from services.bench.stats import median, percentile
from services.common.cache_redis import start_queue_redis, stop_cache_redis
from services.common.local_stack import free_ports
from services.common.status_client import fetch_status

SIDES = ("alone", "background")
ENDED_BATCH = ("completed", "failed", "expired", "cancelled")
SYSTEM = "You are a concise assistant."
TOPICS = ("rivers", "bridges", "volcanoes", "orchards", "lighthouses", "glaciers", "deserts", "harbors")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "async-lane", help="interactive TTFT with and without low-class background work, alternating rounds"
    )
    p.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--phase-seconds", type=float, default=30.0)
    p.add_argument("--load-fraction", type=float, default=0.5, help="interactive rate / saturation rate")
    p.add_argument("--saturation-clients", type=int, default=4)
    p.add_argument("--saturation-requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=32, help="interactive: greedy tokens per chat")
    p.add_argument("--background-max-tokens", type=int, default=64)
    p.add_argument("--backlog", type=int, default=4, help="background responses kept outstanding")
    p.add_argument("--batch-lines", type=int, default=0, help="a batch of this many lines instead (0: none)")
    p.add_argument("--batch-max-tokens", type=int, default=16, help="greedy tokens per batch line")
    p.add_argument(
        "--batch-store-url", default="postgresql://postgres@127.0.0.1:5432/postgres", help="batches.store_url"
    )
    p.add_argument("--drain-concurrency", type=int, default=2, help="queue.drain_concurrency")
    p.add_argument("--drain-max-waiting", type=int, default=0, help="queue.drain_max_waiting")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logs", type=Path, default=None, help="stack logs here (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write the PNG here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvrelay-bench-async-"))
    logs.mkdir(parents=True, exist_ok=True)
    [port] = free_ports(1)
    redis = start_queue_redis(port, str(logs))
    queue = {
        "url": f"redis://127.0.0.1:{port}/0", "drain_concurrency": args.drain_concurrency,
        "drain_max_waiting": args.drain_max_waiting, "drain_poll_ms": 100,
    }  # fmt: skip
    config = logs / "bench-config.yaml"
    # A loaded 2-core machine may take a while per step; what is measured is latency, not a timeout.
    limits = {"step_timeout_ms": 20000, "max_output_tokens": 100, "default_max_output_tokens": 64}
    settings: dict[str, Any] = {"queue": queue, "limits": limits}
    if args.batch_lines:
        settings["batches"] = {"store_url": args.batch_store_url, "table_prefix": "kvrelay_bench_"}
    config.write_text(yaml.safe_dump(settings))
    try:
        with interrupted_by(signal.SIGTERM):
            stack = start_up_stack(UpSettings(args.model, config, logs / "stack"))
            try:
                result = asyncio.run(_measure(stack.url, args))
            finally:
                stack.stop()
    finally:
        stop_cache_redis(redis)
    result["logs"] = str(logs)
    print(_report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
    return 0


@dataclass
class Phase:
    side: str
    records: list[RequestRecord] = field(default_factory=list)
    submitted: int = 0  # background responses (or batch lines) created during the phase
    completed: int = 0  # background responses (or batch lines) that completed during the phase
    batch_done_after_s: float | None = None  # a batch: how long after the load stopped it completed

    def summary(self) -> dict[str, Any]:
        ttfts = [r.ttft_s for r in self.records if r.status == "ok" and r.ttft_s is not None]
        return {
            "side": self.side, "requests": len(self.records), "ok": len(ttfts),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
            "background_submitted": self.submitted, "background_completed": self.completed,
            "background_completed_fraction": self.completed / self.submitted if self.submitted else None,
            "batch_done_after_load_s": self.batch_done_after_s,
        }  # fmt: skip


async def _measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        opts = SendOptions(model=model, max_tokens=args.max_tokens, ignore_eos=True)
        await _chats(http, opts, clients=1, count=2)  # warm-up
        t0 = time.perf_counter()
        finished = await _chats(http, opts, clients=args.saturation_clients, count=args.saturation_requests)
        saturation = finished / (time.perf_counter() - t0)
        rate = saturation * args.load_fraction
        rng = random.Random(args.seed)
        rounds = []
        for index in range(args.rounds):
            order = SIDES if index % 2 == 0 else tuple(reversed(SIDES))
            phases = {}
            for side in order:
                phase = await _phase(http, url, opts, side, rate, args, rng)
                phases[side] = phase.summary()
                await _settle(http, url)
            rounds.append(phases)
    ratios = [
        r["background"]["ttft_p50_s"] / r["alone"]["ttft_p50_s"]
        for r in rounds
        if r["background"]["ttft_p50_s"] and r["alone"]["ttft_p50_s"]
    ]
    fractions = [r["background"]["background_completed_fraction"] or 0.0 for r in rounds]
    return {
        "saturation_rps": saturation, "interactive_rps": rate, "rounds": rounds,
        "ttft_p50_ratios": ratios, "median_ttft_p50_ratio": median(ratios) if ratios else None,
        "background_completed_fractions": fractions, "settings": {k: str(v) for k, v in vars(args).items()},
    }  # fmt: skip


def _messages(i: int) -> list[dict[str, str]]:
    topic = TOPICS[i % len(TOPICS)]
    return [{"role": "user", "content": f"Request {i}: name three facts about {topic}, one line each."}]


async def _chat(http: httpx.AsyncClient, opts: SendOptions, i: int, start_s: float) -> RequestRecord:
    record = RequestRecord(
        job=i, turn=0, kind="chat", protocol="openai-chat", tenant="default", start_s=start_s
    )
    await stream(http, record, SYSTEM, _messages(i), opts)
    return record


async def _chats(http: httpx.AsyncClient, opts: SendOptions, *, clients: int, count: int) -> int:
    """`count` chats over `clients` closed-loop clients; how many ended ok."""
    left = iter(range(count))
    done = 0

    async def client() -> None:
        nonlocal done
        for i in left:
            done += (await _chat(http, opts, i, 0.0)).status == "ok"

    await asyncio.gather(*(client() for _ in range(clients)))
    return done


async def _phase(
    http: httpx.AsyncClient, url: str, opts: SendOptions, side: str, rate: float, args: argparse.Namespace,
    rng: random.Random,
) -> Phase:  # fmt: skip
    phase = Phase(side)
    stop = asyncio.Event()
    feed = _feed_batch if args.batch_lines else _feed
    feeder = asyncio.create_task(feed(http, opts, args, phase, stop)) if side == "background" else None
    t0 = time.perf_counter()
    tasks, at, i = [], 0.0, 0
    while at < args.phase_seconds:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
        tasks.append(asyncio.create_task(_chat(http, opts, 10_000 + i, at)))
        i += 1
        at += rng.expovariate(rate)
    phase.records = list(await asyncio.gather(*tasks))
    stop.set()
    if feeder is not None:
        await feeder
    return phase


async def _feed(
    http: httpx.AsyncClient, opts: SendOptions, args: argparse.Namespace, phase: Phase, stop: asyncio.Event
) -> None:
    """Keep `args.backlog` low-class background responses outstanding until `stop`; then cancel the rest."""
    outstanding: list[str] = []
    n = 0
    while not stop.is_set():
        while len(outstanding) < args.backlog:
            body = {
                "model": opts.model, "input": _messages(n)[0]["content"], "background": True,
                "service_tier": "flex", "max_output_tokens": args.background_max_tokens, "temperature": 0,
            }  # fmt: skip
            reply = await http.post("/v1/responses", json=body)
            reply.raise_for_status()
            outstanding.append(reply.json()["id"])
            phase.submitted += 1
            n += 1
        await asyncio.wait([asyncio.ensure_future(stop.wait())], timeout=0.5)
        for response_id in list(outstanding):
            status = (await http.get(f"/v1/responses/{response_id}")).json()["status"]
            if status in ("completed", "incomplete"):
                phase.completed += not stop.is_set()
                outstanding.remove(response_id)
            elif status in ("failed", "cancelled"):
                outstanding.remove(response_id)
    for response_id in outstanding:
        await http.post(f"/v1/responses/{response_id}/cancel")


async def _feed_batch(
    http: httpx.AsyncClient, opts: SendOptions, args: argparse.Namespace, phase: Phase, stop: asyncio.Event
) -> None:
    """One batch of `args.batch_lines` chat lines, created now; after `stop`, wait for it to complete."""
    lines = [
        json.dumps({
            "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {
                "model": opts.model, "messages": _messages(i), "max_tokens": args.batch_max_tokens,
                "temperature": 0,
            },
        })
        for i in range(args.batch_lines)
    ]  # fmt: skip
    files = {"file": ("bench.jsonl", "\n".join(lines).encode())}
    upload = await http.post("/v1/files", files=files, data={"purpose": "batch"})
    upload.raise_for_status()
    body = {
        "input_file_id": upload.json()["id"],
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    created = await http.post("/v1/batches", json=body)
    created.raise_for_status()
    batch_id = created.json()["id"]
    phase.submitted = args.batch_lines
    await stop.wait()
    phase.completed = (await http.get(f"/v1/batches/{batch_id}")).json()["request_counts"]["completed"]
    stopped = time.perf_counter()
    while (batch := (await http.get(f"/v1/batches/{batch_id}")).json())["status"] not in ENDED_BATCH:
        await asyncio.sleep(0.5)
    if batch["status"] == "completed":
        phase.batch_done_after_s = time.perf_counter() - stopped


async def _settle(http: httpx.AsyncClient, url: str, timeout_s: float = 300.0) -> None:
    """Wait until no worker runs anything and the queue holds nothing."""
    deadline = time.monotonic() + timeout_s
    while True:
        document = await asyncio.to_thread(fetch_status, url)
        workers = [s for s in document["services"] if s["role"] not in ("codec", "router")]
        busy = [(s["name"], s["running"], s["waiting"]) for s in workers if s["running"] or s["waiting"]]
        queue = document.get("queue", {})
        queued = [c for c in queue.get("classes", []) if c["queued"] or c["running"]]
        if not busy and not queued:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the stack never settled between phases: workers {busy}, queue {queued}")
        await asyncio.sleep(0.5)


def _report(result: dict[str, Any]) -> str:
    lines = [
        f"saturation {result['saturation_rps']:.2f} req/s; "
        f"interactive load {result['interactive_rps']:.2f} req/s",
        "round  side        requests  TTFT p50 ms  TTFT p99 ms  background (batch lines) done/submitted",
    ]
    for index, phases in enumerate(result["rounds"]):
        for side in SIDES:
            s = phases[side]
            p50, p99 = (
                s[k] * 1000 if s[k] is not None else float("nan") for k in ("ttft_p50_s", "ttft_p99_s")
            )
            bg = f"{s['background_completed']}/{s['background_submitted']}" if side == "background" else "-"
            if side == "background" and s.get("batch_done_after_load_s") is not None:
                bg += f" (batch completed {s['batch_done_after_load_s']:.1f} s after the load)"
            lines.append(f"{index:>5}  {side:<10}  {s['requests']:>8}  {p50:>11.1f}  {p99:>11.1f}  {bg}")
    ratios = ", ".join(f"{r:.2f}" for r in result["ttft_p50_ratios"])
    lines.append(
        f"TTFT p50 ratio background/alone per round: {ratios}; median {result['median_ttft_p50_ratio']}"
    )
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path) -> None:
    """TTFT p50 per round, alone and with background work beside it."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"round {i}" for i in range(len(result["rounds"]))]
    series = {side: [r[side]["ttft_p50_s"] * 1000 for r in result["rounds"]] for side in SIDES}
    _grouped_bars(ax, labels, series, "%.0f")
    ax.set_ylabel("interactive TTFT p50 (ms)")
    ratio = result["median_ttft_p50_ratio"]
    fig.suptitle(
        f"kvrelay bench async-lane: {result['interactive_rps']:.2f} req/s interactive "
        f"(half of {result['saturation_rps']:.2f}); median ratio {ratio:.2f}"
    )
    _save(fig, path, 110)
