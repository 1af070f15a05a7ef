"""`kvrelay bench admission`: a bounded loopback flood against a real stack, one tenant at ten times its
quota while another is measured.

Starts the stack `kvrelay up` runs (a worker, a router and a codec, under its supervisor:
services/bench/spawn.py), float32, with two API keys: tenant "flooder" with `requests_per_minute` =
--quota-rpm and `max_concurrency` = --flooder-concurrency, and tenant "other" with no quota of its own.
Then (flood.py):

1. unloaded: "other" sends --probes streamed chat requests one after another; TTFT is the time to the
   first SSE event (the codec sends it once the first token exists);
2. loaded: the same probes again, while "flooder" sends --flood-factor × quota requests, spread over
   --flood-seconds, at most --flood-concurrency in flight;
3. end state, once every client is done: the codec's running and queued requests, open quota
   reservations and their tokens, its established client connections, and the worker's running and
   waiting requests and active KV blocks; beside it, the step timeouts and how many gaps between two
   tokens of one request (all tenants) were over 0.5, 1 and 2.5 s, to judge limits.step_timeout_ms.

--flood-prompt-words pads the flooder's prompt, so its prefills run in 512-token chunks beside the
other tenant's decodes.

Prints one JSON document (and writes it to --json). Exits 1 unless the flooder got 429s, "other" got
no errors and the end state is all zero. Bounded: every request has a timeout and the whole run a
deadline (--deadline-seconds).

    kvrelay bench admission --json bench-out/admission_flood.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from services.bench.admission.flood import FloodPlan, measure, readings, settled, wait_settled
from services.bench.spawn import UpSettings, start_up_stack
from services.codec.admission.auth import KeyRecord, key_digest, new_key, write_keys_file

SETTLE_S = 10.0  # connections close asynchronously once the clients are done
TENANTS = ("flooder", "other")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("admission", help="one tenant floods past its quota while another is measured")
    p.add_argument("--model", "--model-dir", dest="model", type=Path,
                   default=Path("models/smollm2-135m-instruct"))  # fmt: skip
    p.add_argument("--quota-rpm", type=int, default=20, help="the flooder's requests per minute")
    p.add_argument("--flood-factor", type=int, default=10)
    p.add_argument("--flood-seconds", type=float, default=20.0, help="the flood is spread over this")
    p.add_argument("--flood-concurrency", type=int, default=32, help="flood requests in flight, at most")
    p.add_argument("--flooder-concurrency", type=int, default=2, help="the flooder's max_concurrency")
    p.add_argument("--probes", type=int, default=30, help="the other tenant's requests per phase")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--flood-prompt-words", type=int, default=0, help="pad the flooder's prompt")
    p.add_argument("--deadline-seconds", type=float, default=600.0)
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    p.add_argument("--logs", type=Path, default=None, help="keep the processes' logs in this directory")
    p.set_defaults(handler=run)


def _plan(args: argparse.Namespace) -> FloodPlan:
    return FloodPlan(
        total=args.flood_factor * args.quota_rpm,
        seconds=args.flood_seconds,
        concurrency=args.flood_concurrency,
        padding=args.flood_prompt_words,
        probes=args.probes,
        max_tokens=args.max_tokens,
    )


def write_config(work: Path, args: argparse.Namespace) -> tuple[Path, dict[str, str]]:
    """The stack's config (served name "flood", float32, the keys file, the flooder's quota) and the
    API key of each tenant."""
    keys: dict[str, str] = {}
    records = []
    for tenant in TENANTS:
        key_id, key = new_key()
        keys[tenant] = key
        records.append(KeyRecord(key_id=key_id, tenant=tenant, sha256=key_digest(key)))
    write_keys_file(work / "keys.yaml", records)
    quota = {"requests_per_minute": args.quota_rpm, "max_concurrency": args.flooder_concurrency}
    config = {
        "model": {"served_name": "flood", "dtype": "float32"},
        "auth": {"keys_file": str(work / "keys.yaml")},
        "quotas": {"tenants": {"flooder": quota}},
    }
    path = work / "bench-admission.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, keys


def _config_echo(args: argparse.Namespace, plan: FloodPlan) -> dict[str, Any]:
    return {
        "quota_rpm": args.quota_rpm,
        "flood_requests": plan.total,
        "flood_seconds": plan.seconds,
        "flood_concurrency": plan.concurrency,
        "flooder_max_concurrency": args.flooder_concurrency,
        "probes": plan.probes,
        "max_tokens": plan.max_tokens,
        "flood_prompt_words": plan.padding,
    }


def run(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="kvrelay-bench-admission-"))
    logs = args.logs or work
    config, keys = write_config(work, args)
    plan = _plan(args)
    stack = start_up_stack(UpSettings(args.model, config, logs))
    try:
        started = time.monotonic()
        result = asyncio.run(asyncio.wait_for(measure(stack.url, keys, plan), args.deadline_seconds))
        result["end_state"] = wait_settled(readings(stack), SETTLE_S)
        result["seconds"] = round(time.monotonic() - started, 1)
        result["config"] = _config_echo(args, plan)
    finally:
        stack.stop()
    result["ok"] = (
        result["flooder"]["statuses"].get("429", 0) > 0
        and not result["unloaded"]["errors"]
        and not result["loaded"]["errors"]
        and settled(result["end_state"])
    )
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0 if result["ok"] else 1
