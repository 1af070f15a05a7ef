"""`kvrelay bench routing`: the router's replica policy next to round-robin on a prefix-heavy multi-turn
workload, in one run.

For each policy of `--policies` (default cost,round_robin), one after another (never two stacks at once,
so none competes with another for the CPU): `kvrelay up --mode colocated --workers 2 --port 0` with a
config that sets `router.policy` and a small KV cache (`--kv-cache-mb`, default 128: about 2900 tokens
per worker, less than the whole workload, so where a turn lands matters); the workload; the counters;
then the stack is stopped (SIGTERM, waited on; SIGKILL past a grace period). The stack is what
`kvrelay up` runs, under its own supervisor (services/bench/spawn.py); each service logs to
`<logs>/<policy>/<service>.log`.

The workload (workload.py), the same seeded one for every policy: `--sessions`
conversations of `--turns` turns sharing one ~`--system-tokens` system prompt, each opening with its own
~`--first-user-tokens` message, with short follow-ups; sessions concurrent, turns in order, streamed,
`--max-tokens` greedy tokens per turn. `--session` says what the router's session affinity sees: `none`
(default; completions with the chat template's token IDs, no session key: the prefix index alone),
`derived` (chat completions: the codec keys the session on the first user turn) or `header`
(chat completions with `x-session-id`). Session affinity comes before the policy, whatever the policy
is, so with `derived` or `header` round_robin is not round-robin for these requests.

Per policy: prefix hit rate (sum of usage cached_tokens over sum of prompt_tokens; all turns, first
turns and follow-ups), TTFT p50/p99 at the client, completion tokens/s and requests/s over the wall time,
requests and prefix-cache tokens per worker (`kvrelay status` counters before and after) and how the
router placed the requests (the `reason` of its `routed` log lines). No timing is asserted; this reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, get_args

from services.bench.plots import plot_routing
from services.bench.routing.report import table_rows
from services.bench.routing.stack import (
    StackSettings,
    counter_delta,
    routing_reasons,
    worker_counters,
    write_config,
)
from services.bench.routing.workload import SESSION_MODES, WorkloadPlan, run_workload, summarize
from services.bench.spawn import UpSettings, interrupted_by, start_up_stack
from services.bench.tables import format_table
from services.common.config import RouterConfig

POLICIES: tuple[str, ...] = get_args(RouterConfig.model_fields["policy"].annotation)
COUNTERS_SETTLE_S = 5.0
AFFINITY_REASONS = frozenset({"session_affinity", "session_placed"})
POLICY_REASONS = {
    "cost": frozenset({"lowest_cost", "prefix_overlap"}),
    "least_loaded": frozenset({"least_loaded"}),
    "round_robin": frozenset({"round_robin"}),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("routing", help="replica policy vs round-robin on a prefix-heavy multi-turn workload")
    p.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    p.add_argument("--policies", default="cost,round_robin", help=f"comma-separated, of {','.join(POLICIES)}")
    p.add_argument("--workers", type=int, default=2, help="colocated workers per stack")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=300, help="shared system prompt, about")
    p.add_argument("--first-user-tokens", type=int, default=200, help="each session's first message, about")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--session",
        choices=SESSION_MODES,
        default="none",
        help="none: no session key (prefix index alone); derived: chat, keyed on the first user turn; "
        "header: chat with x-session-id",
    )
    p.add_argument("--kv-cache-mb", type=int, default=128, help="engine.kv_cache_memory_mb per worker")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--logs", type=Path, default=None, help="stack logs here (default: a new temp dir)")
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG chart here")
    p.set_defaults(handler=run)


def _parse(args: argparse.Namespace) -> tuple[list[str], WorkloadPlan]:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies or set(policies) - set(POLICIES):
        raise SystemExit(f"--policies takes a comma-separated list of {', '.join(POLICIES)}")
    if min(args.workers, args.sessions, args.turns, args.max_tokens) < 1:
        raise SystemExit("--workers, --sessions, --turns and --max-tokens must be at least 1")
    plan = WorkloadPlan(
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        first_user_tokens=args.first_user_tokens,
        max_tokens=args.max_tokens,
        seed=args.seed,
        session=args.session,
    )
    return policies, plan


def run(args: argparse.Namespace) -> int:
    policies, plan = _parse(args)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvrelay-bench-routing-"))
    logs.mkdir(parents=True, exist_ok=True)
    settings = StackSettings(args.model, args.workers, args.kv_cache_mb, args.max_model_len)
    result = _header(args, plan, logs)
    with interrupted_by(signal.SIGTERM):
        for policy in policies:
            result["policies"][policy] = _measure_policy(policy, settings, plan, logs)
    print(_describe(result))
    print(format_table(*table_rows(result)))
    for policy, side in result["policies"].items():
        if side["foreign_reasons"]:
            print(
                f"WARNING: the {policy} stack routed by {', '.join(side['foreign_reasons'])}: the router did "
                f"not apply router.policy={policy} from the config, so this row does not measure {policy}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot_routing(result, args.plot)
    return 0


def _header(args: argparse.Namespace, plan: WorkloadPlan, logs: Path) -> dict[str, Any]:
    return {
        "model": str(args.model),
        "workers": args.workers,
        "kv_cache_mb": args.kv_cache_mb,
        "max_model_len": args.max_model_len,
        "workload": plan.__dict__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "logs": str(logs),
        "policies": {},
    }


def _measure_policy(policy: str, settings: StackSettings, plan: WorkloadPlan, logs: Path) -> dict[str, Any]:
    """One stack with `policy`: the workload's summary, per-worker counters and routing reasons."""
    config = write_config(logs / f"{policy}.yaml", policy, settings)
    stack = start_up_stack(UpSettings(settings.model, config, logs / policy, workers=settings.workers))
    try:
        before = worker_counters(stack.url)
        outcome = asyncio.run(run_workload(stack.url, settings.model, plan))
        after = _settled_counters(stack.url, before, len(outcome["turns"]))
    finally:
        code = stack.stop()
    side = summarize(outcome)
    side["workers"] = counter_delta(before, after)
    side["routing_reasons"] = routing_reasons(stack.services.log_text("router"))
    side["foreign_reasons"] = foreign_reasons(policy, side["routing_reasons"])
    side["up_exit_code"] = code
    side["turns"] = [t.__dict__ for t in outcome["turns"]]
    return side


def foreign_reasons(policy: str, reasons: dict[str, int]) -> list[str]:
    """Routing reasons that neither `policy` nor session affinity gives: the router did not run the
    policy the config asked for."""
    expected = POLICY_REASONS.get(policy, frozenset()) | AFFINITY_REASONS
    return sorted(set(reasons) - expected)


def _settled_counters(
    url: str, before: dict[str, dict[str, int]], requests: int
) -> dict[str, dict[str, int]]:
    """The workers' counters once they count every request sent (the load reports lag about a second)."""
    deadline = time.monotonic() + COUNTERS_SETTLE_S
    while True:
        after = worker_counters(url)
        served = sum(c["requests"] for c in counter_delta(before, after).values())
        if served >= requests or time.monotonic() > deadline:
            return after
        time.sleep(0.5)


def _describe(result: dict[str, Any]) -> str:
    w = result["workload"]
    return (
        f"{result['workers']} colocated workers, {result['kv_cache_mb']} MB KV cache each; {w['sessions']} "
        f"sessions x {w['turns']} turns (system ~{w['system_tokens']} tokens, first message "
        f"~{w['first_user_tokens']}), {w['max_tokens']} tokens per turn, session key: {w['session']}\n"
        "hit rate = cached / prompt tokens (usage); per worker = requests served; routed by = the router's "
        "reasons"
    )
