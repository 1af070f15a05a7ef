"""`kvrelay status`: what each service of a running stack is doing, from the codec's GET /status.

The stack's URL comes from --url, else KVRELAY_URL, else http://127.0.0.1:8000. A stack that does not
answer is one clear line on stderr and exit code 1.

Workers show their role (colocated, prefill or decode) and, in a disaggregated stack, their KV transfer
counters: bytes sent (prefill) or received (decode), remote prefills, and remote prefills that fell back
to a local recompute. Each worker also shows the weights it serves (model.weights resolved, the largest
step its C kernels take, the weights' resident bytes) and how many engine steps took each path (the C
kernels, torch's GEMMs), and the KV tiers below its pool (docs/kv-tiers.md): each one's state (DOWN
while its breaker is open), its hits/misses in segments and, where known, the bytes it holds. `--json`
prints the codec's document unchanged. With the async lane's queue (queue.url), one more line says what
waits and runs there per priority class, and the oldest job's age. The document comes from
services/common/status_client.py (which the benchmarks read counters with too).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from services.common.status_client import StackUnreachableError, fetch_status

DEFAULT_URL = "http://127.0.0.1:8000"
URL_ENV = "KVRELAY_URL"
EXIT_UNREACHABLE = 1

COLUMNS = (
    "NAME",
    "ROLE",
    "ADDRESS",
    "READY",
    "RUNNING",
    "WAITING",
    "REQUESTS",
    "KV ACTIVE/CACHED/FREE/TOTAL",
    "PREFIX HITS/QUERIES",
    "KV XFER BYTES",
    "REMOTE/FALLBACKS",
    "WEIGHTS",
    "STEPS KERNELS/GEMM",
    "KV TIERS",
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="show what each service of a running stack is doing")
    p.add_argument("--json", action="store_true", help="print the status document as JSON")
    p.add_argument("--url", default=None, help=f"the stack's URL (default: ${URL_ENV} or {DEFAULT_URL})")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    url = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    try:
        document = fetch_status(url)
    except StackUnreachableError as exc:
        print(f"kvrelay status: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    if args.json:
        print(json.dumps(document, indent=2))
        return 0
    print(format_table(document["services"]))
    if "queue" in document:
        print(format_queue(document["queue"]))
    return 0


def format_queue(queue: Mapping[str, Any]) -> str:
    """One line: the queue's jobs by class (queued/running) and the oldest one's age, or that it is down."""
    if not queue.get("up"):
        return "queue: DOWN (its Redis does not answer: background responses are refused)"
    parts = [f"{c['class']} {c['queued']}/{c['running']}" for c in queue["classes"]]
    oldest = max((c["oldest_age_s"] for c in queue["classes"]), default=0.0)
    return f"queue (queued/running): {', '.join(parts)}; oldest {oldest:.1f} s"


def format_table(services: Sequence[Mapping[str, Any]]) -> str:
    """One aligned row per service; a missing field shows as '-'."""
    rows = [list(COLUMNS), *(_row(service) for service in services)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _row(service: Mapping[str, Any]) -> list[str]:
    kv = service.get("kv_blocks") or {}
    prefix = service.get("prefix_cache") or {}
    ready = service.get("ready")
    return [
        _cell(service.get("name")),
        _cell(service.get("role")),
        _cell(service.get("address")),
        "-" if ready is None else ("yes" if ready else "no"),
        _cell(service.get("running")),
        _cell(service.get("waiting")),
        _cell(service.get("requests_total")),
        "/".join(_cell(kv.get(key)) for key in ("active", "cached", "free", "total")),
        "/".join(_cell(prefix.get(key)) for key in ("hits", "queries")),
        _cell(service.get("kv_transfer_bytes_total")),
        "/".join(_cell(service.get(key)) for key in ("remote_prefills_total", "prefill_fallbacks_total")),
        _weights_cell(service),
        _steps_cell(service.get("steps_by_path")),
        _tiers_cell(service.get("kv_tiers")),
    ]


def _tiers_cell(tiers: Sequence[Mapping[str, Any]] | None) -> str:
    """e.g. "disk:up,3/1,12MB shared:DOWN,0/0": each tier below the pool, its hits/misses in segments,
    and the bytes it holds where known."""
    if not tiers:
        return "-"
    cells = []
    for tier in tiers:
        cell = f"{tier['name']}:{'up' if tier['up'] else 'DOWN'},{tier['hits']}/{tier['misses']}"
        if tier["used_bytes"] >= 0:
            cell += f",{tier['used_bytes'] / 2**20:.0f}MB"
        cells.append(cell)
    return " ".join(cells)


def _weights_cell(service: Mapping[str, Any]) -> str:
    """e.g. "gguf-hybrid(<=12,349MB)": the weights served, the largest step the C kernels take, and the
    weights' resident bytes; "gguf-int8(deterministic,90MB)" under engine.deterministic."""
    weights = service.get("weights")
    if weights is None:
        return "-"
    details = []
    if service.get("numerics") == "deterministic":
        details.append("deterministic")
    if service.get("small_step_max_tokens"):
        details.append(f"<={service['small_step_max_tokens']}")
    if service.get("weight_bytes"):
        details.append(f"{service['weight_bytes'] / 2**20:.0f}MB")
    return f"{weights}({','.join(details)})" if details else str(weights)


def _steps_cell(steps: Mapping[str, int] | None) -> str:
    if steps is None:
        return "-"
    return f"{steps.get('kernels', 0)}/{steps.get('gemm', 0)}"


def _cell(value: object) -> str:
    return "-" if value is None else str(value)
