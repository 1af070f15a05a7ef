"""What `kvrelay bench routing` gives and takes from each stack: the config it starts with (the policy,
a small KV cache), the workers' counters before and after (from `kvrelay status`'s document) and how the
router placed each request (the `reason` of the `routed` lines in the router's log). The stack itself is
started by services/bench/spawn.py.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.status_client import StackUnreachableError, fetch_status

WORKER_ROLES = ("colocated", "decode")


@dataclass(frozen=True)
class StackSettings:
    model: Path
    workers: int
    kv_cache_mb: int
    max_model_len: int


def write_config(path: Path, policy: str, settings: StackSettings) -> Path:
    path.write_text(
        f"engine:\n  kv_cache_memory_mb: {settings.kv_cache_mb}\n  max_model_len: {settings.max_model_len}\n"
        f"router:\n  policy: {policy}\n"
    )
    return path


def worker_counters(url: str) -> dict[str, dict[str, int]]:
    """Per worker (from `kvrelay status --json`'s document): requests served and prefix-cache tokens."""
    try:
        services = fetch_status(url)["services"]
    except StackUnreachableError:
        return {}
    return {
        str(s["name"]): {
            "requests": int(s.get("requests_total") or 0),
            "prefix_queries": int((s.get("prefix_cache") or {}).get("queries") or 0),
            "prefix_hits": int((s.get("prefix_cache") or {}).get("hits") or 0),
        }
        for s in services
        if s.get("role") in WORKER_ROLES
    }


def counter_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, Any]:
    return {
        name: {key: value - before.get(name, {}).get(key, 0) for key, value in counts.items()}
        for name, counts in sorted(after.items())
    }


def routing_reasons(log_text: str) -> dict[str, int]:
    """How the router placed each request it finished: the `reason` of its `routed` log lines."""
    reasons: Counter[str] = Counter()
    for line in log_text.splitlines():
        if '"routed"' not in line:
            continue
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("msg") == "routed":
            reasons[str(entry.get("reason"))] += 1
    return dict(sorted(reasons.items()))
