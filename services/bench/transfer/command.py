"""`kvrelay bench transfer`: what moving the KV cache between processes costs, measured on loopback.

It starts its own processes on free loopback ports with a random internal token, one stack at a time (so
no two stacks compete for the CPU), under `kvrelay up`'s supervisor (stack.py), and stops them all in the
end, on Ctrl-C or SIGTERM too:

- disaggregated, per transport (`--transports`, default grpc,torch,ipc): a prefill worker (P) and a decode
  worker (D) with `--threads` torch threads each (default 1) and a router over both;
- colocated: one worker with P's and D's threads together (default 2: the same cores in total) and a router.

1. Transfer. Per prompt length (`--prompt-lengths`, default 512,2000) `--repeats` requests, one at a
   time, each with a fresh random prompt (so no prefix cache hides the transfer), `--new-tokens` greedy
   tokens. Medians of:
   - bytes per request: the KV bytes D received (`kv_transfer_bytes` on the last response); per prompt
     token it is layers x 2 (K and V) x KV heads x head dim x element size;
   - transfer_s: `kv_transfer_seconds`, measured on D from the start of its Prefill call to P until the
     KV is installed. It therefore includes P computing the prompt, not only the bytes on the wire;
   - TTFT and the time to the second token, at the client (through the router);
   - transfer_s / time_to_second_token_s: P sends the first token in its header BEFORE the KV chunks, and
     D forwards it at once, so the transfer cannot delay the first token; D can decode the second token
     only once the KV is installed. This share is the part of the wait for the second token spent on
     the Prefill call (prefill plus shipping); the rest is the hops and one decode step.
   - transfer_s / ttft_s: the issue's "transfer time as a share of TTFT". Above 1 is expected: the first
     token left P before the KV did. transfer_s - ttft_s is roughly the shipping done after it (roughly:
     TTFT also holds the client-router-D hops that transfer_s does not);
   - the gap between the first and second token against the later inter-token time: the extra in the
     gap is what the shipping adds to the second token.
   A transport whose requests do not come back PREFILL_MODE_REMOTE (for example torch.distributed not
   available, so D recomputed) is reported as skipped, with D's reason.
   The colocated stack serves the same lengths for reference (no transfer; TTFT is its own prefill).
2. Load. For `--load-seconds`, short requests (`--short-tokens` prompt, `--short-new-tokens`) are sent
   every `--short-interval` seconds (open loop), while `--long-concurrency` loops each send a
   `--long-tokens` prompt as soon as their previous one finished (closed loop: a long prefill is always
   under way, at whatever speed this machine has). Reported: short-request TTFT p50/p99 and the long
   requests' TTFT p50, for
   - colocated;
   - disaggregated, all on P: `disaggregation.policy: always`, every prompt prefilled on P;
   - disaggregated, < N on D: `always` with `min_prompt_tokens: N` (`--local-below`), so short prompts
     are prefilled on D and skip P's queue;
   - disaggregated, router decides: `policy: conditional` (the default: the router's cost estimate).
   The three disaggregated sides are three routers over the same P and D, measured one after another;
   the stack of the first transport that worked serves them.

`--dtype` defaults to float32: weights, compute and KV are all 4-byte floats, so the byte counts are
plain (with `auto` the KV dtype is whatever the engine picks on this CPU). The transfer timeout is raised
to 120 s so a slow CPU's long prefill is measured rather than recomputed. No timing is asserted; this
reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

from services.bench.plots import plot_transfer
from services.bench.spawn import interrupted_by
from services.bench.transfer.client import LoadPlan, Timing, load_run, summarize_transfer, transfer_runs
from services.bench.transfer.report import print_result
from services.bench.transfer.stack import (
    Fleet,
    Stack,
    WorkerSettings,
    start_colocated,
    start_disaggregated,
    vocab_size,
)

ALL_REMOTE = "disaggregated, all on P"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("transfer", help="KV transfer cost and short-request TTFT, disaggregated vs colocated")
    p.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="float32")
    p.add_argument("--prompt-lengths", default="512,2000", help="comma-separated prompt lengths (tokens)")
    p.add_argument("--transports", default="grpc,torch,ipc", help="comma-separated: grpc, torch, ipc")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=8, help="tokens per transfer request (at least 3)")
    p.add_argument("--threads", type=int, default=1, help="per P and D worker; colocated gets twice this")
    p.add_argument("--kv-cache-mb", type=int, default=512)
    p.add_argument("--load-seconds", type=float, default=30.0, help="0 skips the load measurement")
    p.add_argument("--short-tokens", type=int, default=32)
    p.add_argument("--short-new-tokens", type=int, default=16)
    p.add_argument("--short-interval", type=float, default=0.5, help="seconds between short requests")
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--long-new-tokens", type=int, default=16)
    p.add_argument("--long-concurrency", type=int, default=1)
    p.add_argument(
        "--local-below", type=int, default=256, help="min_prompt_tokens of the split side; 0: none"
    )
    p.add_argument("--logs", type=Path, default=None, help="child logs here (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG chart here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    lengths, transports, plan = _parse(args)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvrelay-bench-transfer-"))
    logs.mkdir(parents=True, exist_ok=True)
    fleet = Fleet(logs, secrets.token_urlsafe(24), WorkerSettings(args.model, args.dtype, args.kv_cache_mb))
    result = _header(args, lengths, plan, logs)
    try:
        with interrupted_by(signal.SIGINT, signal.SIGTERM):
            _measure_all(fleet, args, lengths, transports, plan, result)
    except KeyboardInterrupt:
        fleet.stop_all()
        print("kvrelay bench transfer: interrupted; its processes are stopped", file=sys.stderr)
        return 130
    finally:
        fleet.stop_all()
    print_result(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(_finite(result), indent=1))
    if args.plot:
        plot_transfer(result, args.plot)
    return 0


def _parse(args: argparse.Namespace) -> tuple[list[int], list[str], LoadPlan]:
    lengths = [int(x) for x in args.prompt_lengths.split(",") if x.strip()]
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if not lengths or not transports or set(transports) - {"grpc", "torch", "ipc"}:
        raise SystemExit("--prompt-lengths needs numbers, --transports a list of grpc, torch and ipc")
    if args.new_tokens < 3 or args.repeats < 1:
        raise SystemExit("--new-tokens must be at least 3 (the second token and one gap after it)")
    if args.local_below and not args.short_tokens < args.local_below <= args.long_tokens:
        raise SystemExit("--local-below must be above --short-tokens and at most --long-tokens")
    plan = LoadPlan(
        seconds=args.load_seconds,
        short_tokens=args.short_tokens,
        short_new_tokens=args.short_new_tokens,
        short_interval_s=args.short_interval,
        long_tokens=args.long_tokens,
        long_new_tokens=args.long_new_tokens,
        long_concurrency=args.long_concurrency,
    )
    return lengths, transports, plan


def _header(args: argparse.Namespace, lengths: list[int], plan: LoadPlan, logs: Path) -> dict[str, Any]:
    return {
        "model": str(args.model),
        "dtype": args.dtype,
        "threads": {"prefill": args.threads, "decode": args.threads, "colocated": 2 * args.threads},
        "prompt_lengths": lengths,
        "repeats": args.repeats,
        "new_tokens": args.new_tokens,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "logs": str(logs),
        "transfer": {},
        "colocated": {},
        "load": {"plan": plan.__dict__, "local_below": args.local_below, "sides": {}},
    }


def _measure_all(
    fleet: Fleet, args: argparse.Namespace, lengths: list[int], transports: list[str], plan: LoadPlan,
    result: dict[str, Any],
) -> None:  # fmt: skip
    want_load = plan.seconds > 0
    for i, transport in enumerate(transports):
        entry, loads = _disaggregated_phase(fleet, args, transport, lengths, plan if want_load else None, i)
        result["transfer"][transport] = entry
        result["load"]["sides"].update(loads)
        want_load = want_load and not loads
    stack = start_colocated(fleet, "colocated", 2 * args.threads)
    try:
        address = stack.routers["default"]
        vocab = vocab_size(fleet, address)
        runs = asyncio.run(
            transfer_runs(address, fleet.metadata, lengths, args.repeats, args.new_tokens, vocab, 99)
        )
        result["colocated"] = {str(n): summarize_transfer(r) for n, r in runs.items()}
        if plan.seconds > 0:
            load = asyncio.run(load_run(address, fleet.metadata, plan, vocab, 6))
            result["load"]["sides"] = {"colocated": load, **result["load"]["sides"]}
    finally:
        fleet.stop(stack)


def _routers(args: argparse.Namespace, with_load: bool) -> dict[str, dict[str, str]]:
    """The disaggregated sides, each a router over the same P and D. The first serves the transfer
    measurement: every prompt prefilled on P, whatever the router's cost estimate says."""
    policy, floor = "KVRELAY_DISAGGREGATION__POLICY", "KVRELAY_DISAGGREGATION__MIN_PROMPT_TOKENS"
    routers = {ALL_REMOTE: {policy: "always", floor: "0"}}
    if with_load and args.local_below:
        routers[f"disaggregated, < {args.local_below} on D"] = {
            policy: "always",
            floor: str(args.local_below),
        }
    if with_load:
        routers["disaggregated, router decides"] = {policy: "conditional", floor: "0"}
    return routers


def _disaggregated_phase(
    fleet: Fleet, args: argparse.Namespace, transport: str, lengths: list[int], plan: LoadPlan | None,
    index: int,
) -> tuple[dict[str, Any], dict[str, Any]]:  # fmt: skip
    """The transfer measurement on one transport, and the load measurement too when `plan` is given."""
    try:
        stack = start_disaggregated(
            fleet, transport, transport, args.threads, _routers(args, plan is not None)
        )
    except (RuntimeError, TimeoutError, grpc.RpcError) as exc:
        return {"status": "skipped", "reason": f"the stack did not start: {str(exc)[:500]}"}, {}
    try:
        address = stack.routers[ALL_REMOTE]
        vocab = vocab_size(fleet, address)
        seed = 1 + index
        try:
            runs = asyncio.run(
                transfer_runs(address, fleet.metadata, lengths, args.repeats, args.new_tokens, vocab, seed)
            )
        except grpc.aio.AioRpcError as exc:
            return {"status": "skipped", "reason": f"request failed: {exc.code().name} {exc.details()}"}, {}
        entry = _transfer_entry(runs, stack)
        if plan is None or entry["status"] != "ok":
            return entry, {}
        loads = {
            f"{name} ({transport})": asyncio.run(load_run(addr, fleet.metadata, plan, vocab, 7 + i))
            for i, (name, addr) in enumerate(stack.routers.items())
        }
        return entry, loads
    finally:
        fleet.stop(stack)


def _transfer_entry(runs: dict[int, list[Timing]], stack: Stack) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "status": "ok",
        "lengths": {str(n): summarize_transfer(r) for n, r in runs.items()},
    }
    modes = sorted({t.prefill_mode for timings in runs.values() for t in timings})
    if modes != ["REMOTE"]:
        entry["status"] = "skipped"
        entry["reason"] = f"prefill_mode {','.join(modes)}, not REMOTE; decode log: {_fallback_reason(stack)}"
    return entry


def _fallback_reason(stack: Stack) -> str:
    """The reason of the decode worker's last 'remote prefill failed' log line."""
    reason = "no fallback logged"
    for line in stack.log_tail("decode", 200_000).splitlines():
        if "remote prefill failed" not in line:
            continue
        try:
            reason = str(json.loads(line).get("reason", line))
        except (ValueError, AttributeError):
            reason = line
    return reason[:300]


def _finite(value: Any) -> Any:
    """NaN and infinities as null, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
