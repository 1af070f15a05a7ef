"""`kvrelay bench soak`: the whole local stack under steady mixed traffic for a set time, every process's
memory, file descriptors, threads and the stack's connections and KV sampled throughout, and a verdict.

Starts the stack `kvrelay up` runs (services/bench/spawn.py) with one API key whose tenant has quotas (so
quota reservations are taken and returned on every request), sends traffic.py's mix (every protocol,
streamed and not, tools, structured output, 15% cancels) at `--rate` Poisson arrivals for `--duration`
seconds, and samples (samples.py) every `--sample-s`. Once the traffic ends and the stack has settled:

- per process: the Theil-Sen slope of RSS after `--warmup` s, per 10 minutes, against the larger of 0.5%
  of its RSS and 1.5 MB; fds and threads flat;
- the codec's client connections flat;
- end state: no running or queued request, no open quota reservation, no client connection, no active KV
  block, no waiting request in the worker;
- zero server errors (5xx, error events in a 200 stream, dropped connections), cancels at least 10%.

`--leak-kb N` starts a second codec on the same router, `codec-leaky`, with the test-only leak switch on
(KVRELAY_TEST_LEAK_KB: every finished request's state is kept with N KB beside it), and sends it a quarter
of the requests: in the same run, the verdict must flag that codec's RSS as growing while every other
process stays flat (and the end-state checks hold for both codecs). Prints a summary; `--json` and
`--plot` (PNG: RSS per process over time) keep the figures. The issue's soak is

    kvrelay bench soak --duration 2400 --warmup 600 --rate 2 --leak-kb 16 \
        --json bench-out/soak.json --plot bench-out/soak.png
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from services.bench.admission.flood import Readings, end_state, readings, settled, wait_settled
from services.bench.plots import plot_soak
from services.bench.soak.samples import Series, connections_verdict, process_sample, process_verdict
from services.bench.soak.traffic import REQUEST_TIMEOUT_S, Outcomes, Traffic, drive
from services.bench.spawn import SupervisedStack, UpSettings, UpStack, up_plan, up_specs
from services.codec.admission.auth import KeyRecord, key_digest, new_key, write_keys_file
from services.codec.middleware import LEAK_ENV
from services.common.config import LimitsConfig
from services.common.local_stack import INTERNAL_HOST, free_ports, public_url
from services.common.probes import HttpReadyCheck
from services.common.supervisor import ServiceSpec

TENANT = "soak"
LEAKY = "codec-leaky"
LEAKY_SHARE = 0.25  # of the requests, sent to the leaky codec
SETTLE_S = 30.0
MIN_CANCEL_SHARE = 0.10
STORED_RESPONSES = 100


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "soak", help="the local stack under mixed traffic for a while: memory, fds, KV, errors"
    )
    p.add_argument("--model", "--model-dir", dest="model", type=Path,
                   default=Path("models/smollm2-135m-instruct"))  # fmt: skip
    p.add_argument("--duration", type=float, default=300.0, help="s of traffic, the warm-up included")
    p.add_argument("--warmup", type=float, default=60.0, help="s of traffic the slopes leave out")
    p.add_argument("--rate", type=float, default=2.0, help="requests/s (Poisson)")
    p.add_argument("--sample-s", type=float, default=10.0, help="s between two samples")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--leak-kb", type=int, default=0, help="test only: the codec keeps N KB per request")
    p.add_argument(
        "--step-timeout-ms", type=int, default=None, help="limits.step_timeout_ms (unset: the default)"
    )
    p.add_argument("--json", type=Path, default=None, help="write the samples and verdict here")
    p.add_argument("--plot", type=Path, default=None, help="write RSS per process over time here (PNG)")
    p.add_argument("--logs", type=Path, default=None, help="keep the processes' logs in this directory")
    p.set_defaults(handler=run)


def write_config(work: Path, step_timeout_ms: int | None = None) -> tuple[Path, str]:
    """The stack's config (served name "soak", a keys file, quotas high enough never to refuse, the step
    timeout when given, with a request timeout that allows it) and the tenant's API key."""
    key_id, key = new_key()
    write_keys_file(work / "keys.yaml", [KeyRecord(key_id=key_id, tenant=TENANT, sha256=key_digest(key))])
    quota = {"requests_per_minute": 100_000, "tokens_per_minute": 100_000_000, "max_concurrency": 512}
    config = {
        "model": {"served_name": TENANT},
        "auth": {"keys_file": str(work / "keys.yaml")},
        "quotas": {"tenants": {TENANT: quota}},
        # Stored Responses are a bounded cache: capped low, it fills during the warm-up and then evicts,
        # so its growth to the (256 MB) default cap is not read as a leak.
        "responses": {"max_per_tenant": STORED_RESPONSES},
    }
    if step_timeout_ms is not None:
        defaults = LimitsConfig()
        config["limits"] = {
            "step_timeout_ms": step_timeout_ms,
            "request_timeout_ms": max(
                defaults.request_timeout_ms, step_timeout_ms * defaults.max_output_tokens
            ),
        }
    path = work / "bench-soak.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, key


def _leaky_codec(codec: ServiceSpec, leak_kb: int, logs: Path) -> ServiceSpec:
    """A second codec beside `codec`, on a free port, with the test-only leak switch on."""
    port = free_ports(1)[0]
    argv = list(codec.argv)
    argv[argv.index("--port") + 1] = str(port)
    return replace(
        codec, name=LEAKY, argv=argv, env={**codec.env, LEAK_ENV: str(leak_kb)}, port=port,
        health=HttpReadyCheck(f"{public_url(INTERNAL_HOST, port)}/ready"), log_path=logs / f"{LEAKY}.log",
    )  # fmt: skip


def start_stack(args: argparse.Namespace, config: Path, logs: Path) -> tuple[UpStack, str | None]:
    """The stack `kvrelay up` runs, plus with --leak-kb a second codec on the same router with the leak
    switch on; the stack and that codec's URL."""
    plan = up_plan(UpSettings(args.model, config, logs))
    specs = up_specs(plan, logs)
    leaky_url = None
    if args.leak_kb:
        (codec,) = [s for s in specs if s.name == "codec"]
        specs.append(_leaky_codec(codec, args.leak_kb, logs))
        leaky_url = public_url(INTERNAL_HOST, specs[-1].port)
    services = SupervisedStack(specs).start()
    return UpStack(public_url(INTERNAL_HOST, plan.ports.codec), plan, services), leaky_url


def _stack_sample(at: Readings) -> dict[str, Any] | None:
    try:
        state = end_state(at)
    except Exception:  # a failed reading is a gap in the series, not the end of the soak
        return None
    state.pop("token_gaps", None)
    return state


async def _sample(stack: UpStack, at: Readings, series: Series, t0: float) -> None:
    processes = {name: process_sample(pid) for name, pid in stack.services.pids().items()}
    series.add(time.monotonic() - t0, processes, await asyncio.to_thread(_stack_sample, at))


def _client(url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=16)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0)
    return httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False)


async def soak(
    args: argparse.Namespace, stack: UpStack, leaky_url: str | None, key: str
) -> tuple[Series, Outcomes]:
    """The traffic and the sampler side by side; one last sample once the traffic has ended."""
    at, series, outcomes = readings(stack), Series(), Outcomes()
    async with contextlib.AsyncExitStack() as clients:
        targets = [await clients.enter_async_context(_client(stack.url))]
        if leaky_url:
            targets.append(await clients.enter_async_context(_client(leaky_url)))
        t0 = time.monotonic()
        plan = Traffic(
            args.rate, args.duration, args.max_tokens, args.seed, LEAKY_SHARE if leaky_url else 0.0
        )
        traffic = asyncio.create_task(drive(targets, TENANT, key, plan, outcomes))
        while not traffic.done():
            await _sample(stack, at, series, t0)
            await asyncio.wait({traffic}, timeout=args.sample_s)
        await traffic
    await _sample(stack, at, series, t0)
    return series, outcomes


def verdict(
    args: argparse.Namespace,
    series: Series,
    outcomes: Outcomes,
    end: dict[str, Any],
    restarts: dict[str, int],
) -> dict[str, Any]:
    processes = {name: process_verdict(series, name, args.warmup) for name in series.processes}
    connections = connections_verdict(series, args.warmup)
    total = outcomes.total()
    cancel_share = outcomes.total("cancelled") / total if total else 0.0
    checks = {
        "end_state_zero": settled(end),
        "no_server_errors": outcomes.total("server_error") == 0,
        "cancels_at_least_10_percent": cancel_share >= MIN_CANCEL_SHARE,
        "connections_flat": connections["ok"],
        "no_process_restarted": not any(restarts.values()),
    }
    checks["processes_flat"] = all(p["ok"] for name, p in processes.items() if name != LEAKY)
    if args.leak_kb:
        checks["leak_flagged"] = bool(processes.get(LEAKY, {}).get("rss_growing"))
    return {
        "ok": all(checks.values()),
        "checks": checks,
        "processes": processes,
        "connections": connections,
        "end_state": end,
        "restarts": restarts,
        "cancel_share": round(cancel_share, 3),
        "achieved_rate": round(total / args.duration, 2),
    }


def _process_line(name: str, p: dict[str, Any]) -> str:
    if "rss_slope_mb_per_10_min" not in p:
        return f"  {name}: {p['why']}"
    rss = p["rss_mb_first_last"]
    state = "ok" if p["ok"] else f"GROWING: {p['why']}"
    return (
        f"  {name}: RSS {rss[0]} -> {rss[1]} MB, slope {p['rss_slope_mb_per_10_min']:+.3f} MB/10 min "
        f"(bar {p['rss_bar_mb_per_10_min']:.2f}), fds {p['fds_first_last']}, threads "
        f"{p['threads_first_last']}: {state}"
    )


def _summary(result: dict[str, Any]) -> str:
    v, config, traffic = result["verdict"], result["config"], result["traffic"]
    lines = [
        f"soak: {config['duration_s']:g} s ({config['warmup_s']:g} s warm-up) at {config['rate']:g} req/s: "
        f"{traffic['total']} requests, {traffic['server_error']} server errors, "
        f"{v['cancel_share']:.0%} cancelled"
    ]
    lines += [_process_line(name, p) for name, p in v["processes"].items()]
    lines.append(f"  checks: {json.dumps(v['checks'])}")
    lines.append(f"verdict: {'PASS' if v['ok'] else 'FAIL'}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if (
        min(args.duration, args.rate, args.sample_s, args.max_tokens) <= 0
        or not 0 <= args.warmup < args.duration
    ):
        raise SystemExit(
            "kvrelay bench soak: --duration, --rate, --sample-s, --max-tokens > 0; 0 <= --warmup < --duration"
        )
    work = Path(tempfile.mkdtemp(prefix="kvrelay-bench-soak-"))
    logs = args.logs or work
    config, key = write_config(work, args.step_timeout_ms)
    stack, leaky_url = start_stack(args, config, logs)
    try:
        series, outcomes = asyncio.run(soak(args, stack, leaky_url, key))
        restarts = stack.services.restarts()
        end = wait_settled(readings(stack), SETTLE_S)
        if leaky_url:
            leaky = replace(readings(stack), url=leaky_url, codec_pid=stack.services.pids()[LEAKY],
                            codec_port=int(leaky_url.rsplit(":", 1)[1]))  # fmt: skip
            codec_side = {
                k: v for k, v in wait_settled(leaky, SETTLE_S).items() if not k.startswith("worker")
            }
            end |= {
                f"{LEAKY}_{k}": v for k, v in codec_side.items() if k not in ("step_timeouts", "token_gaps")
            }
    finally:
        stack.stop()
    end.pop("token_gaps", None)
    result = {
        "config": {
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "rate": args.rate,
            "sample_s": args.sample_s,
            "max_tokens": args.max_tokens,
            "seed": args.seed,
            "leak_kb": args.leak_kb,
        },
        "traffic": outcomes.as_json(),
        "series": series.as_json(),
    }
    result["verdict"] = verdict(args, series, outcomes, end, restarts)
    print(_summary(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot_soak(result, args.plot)
    return 0 if result["verdict"]["ok"] else 1
