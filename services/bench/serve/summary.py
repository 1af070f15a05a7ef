"""The numbers of `kvrelay bench serve`, from the request records of one run.

Per group of requests (all, per protocol, per kind, per tenant), over the run's wall time (first request
out to last one done, the same window for every group, so the groups' rates add up):
- TTFT: request sent to first text event; e2e: request sent to end of stream;
- TPOT: (e2e - TTFT) / (completion tokens - 1), per request with at least two tokens;
- ITL: every gap between two consecutive text events, all requests pooled;
- each at p50, p90 and p99 (linear interpolation between order statistics) and the mean, in ms, over the
  completed requests (`ok`); a cancelled request adds its TTFT only (services/bench/stats.py);
- requests/s and output tokens/s of completed requests; goodput: completed requests/s that met both
  SLOs (TTFT <= slo_ttft_ms and TPOT <= slo_tpot_ms; a request without a TPOT meets that SLO);
- prefix hit rate: the usage's cached prompt tokens over its prompt tokens (None where unreported).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.bench.serve.clients import RequestRecord
from services.bench.stats import distribution

ERROR_SAMPLES = 5


@dataclass(frozen=True)
class Slo:
    ttft_ms: float
    tpot_ms: float


def tpot_s(record: RequestRecord) -> float | None:
    tokens = record.completion_tokens or 0
    if record.ttft_s is None or record.e2e_s is None or tokens < 2:
        return None
    return (record.e2e_s - record.ttft_s) / (tokens - 1)


def itls_s(record: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(record.deltas_s, record.deltas_s[1:], strict=False)]


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    tpot = tpot_s(record)
    ttft_ok = record.ttft_s is not None and 1000 * record.ttft_s <= slo.ttft_ms
    return ttft_ok and (tpot is None or 1000 * tpot <= slo.tpot_ms)


def _rate(count: float, wall_s: float) -> float:
    return round(count / wall_s, 4) if wall_s > 0 else 0.0


def _token_sums(records: list[RequestRecord]) -> dict[str, Any]:
    reported = [r for r in records if r.prompt_tokens is not None]
    prompt = sum(r.prompt_tokens or 0 for r in reported)
    cached_known = [r for r in reported if r.cached_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in cached_known)
    hit_rate = round(cached / prompt, 4) if cached_known and prompt else None
    return {
        "prompt_tokens": prompt if reported else None,
        "cached_tokens": cached,
        "prefix_hit_rate": hit_rate,
    }


def summarize(records: list[RequestRecord], wall_s: float, slo: Slo) -> dict[str, Any]:
    """The numbers of one group of records (see the module docstring)."""
    ok = [r for r in records if r.status == "ok"]
    counts = {s: sum(1 for r in records if r.status == s) for s in ("ok", "cancelled", "error", "timeout")}
    completion = sum(r.completion_tokens or 0 for r in ok)
    tpots = [t for t in map(tpot_s, ok) if t is not None]
    good = sum(1 for r in ok if meets_slo(r, slo))
    return {
        "requests": len(records),
        "completed": counts["ok"],
        "cancelled": counts["cancelled"],
        "errors": counts["error"],
        "timeouts": counts["timeout"],
        "error_samples": [r.error for r in records if r.error][:ERROR_SAMPLES],
        "ttft_ms": distribution(r.ttft_s for r in records if r.ttft_s is not None and r.status != "error"),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution(gap for r in ok for gap in itls_s(r)),
        "e2e_ms": distribution(r.e2e_s for r in ok if r.e2e_s is not None),
        "wall_s": round(wall_s, 3),
        "requests_per_s": _rate(counts["ok"], wall_s),
        "output_tok_s": _rate(completion, wall_s),
        "goodput_rps": _rate(good, wall_s),
        "slo_attainment": round(good / len(ok), 4) if ok else None,
        "completion_tokens": completion,
        "tokens_from_usage": all(r.tokens_from_usage for r in ok),
        **_token_sums(ok),
    }


def grouped(
    records: list[RequestRecord], key: Callable[[RequestRecord], str], wall_s: float, slo: Slo
) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[RequestRecord]] = {}
    for record in records:
        groups.setdefault(key(record), []).append(record)
    return {name: summarize(group, wall_s, slo) for name, group in sorted(groups.items())}


def run_summary(records: list[RequestRecord], wall_s: float, slo: Slo) -> dict[str, Any]:
    """All records, then per protocol, per kind and per tenant."""
    return {
        "summary": summarize(records, wall_s, slo),
        "by_protocol": grouped(records, lambda r: r.protocol, wall_s, slo),
        "by_kind": grouped(records, lambda r: r.kind, wall_s, slo),
        "by_tenant": grouped(records, lambda r: r.tenant, wall_s, slo),
    }
