"""The table of `kvrelay bench routing` (command.py says what each number is; plots.py draws the chart)."""

from __future__ import annotations

from typing import Any

HEADER = [
    "policy", "requests", "hit rate", "follow-up hit", "TTFT p50 ms", "TTFT p99 ms", "follow-up p50 ms",
    "tok/s", "req/s", "per worker", "routed by", "errors",
]  # fmt: skip


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.0f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _row(policy: str, side: dict[str, Any]) -> list[str]:
    per_worker = "/".join(str(w["requests"]) for w in side["workers"].values()) or "-"
    reasons = ",".join(f"{reason}:{n}" for reason, n in side["routing_reasons"].items()) or "-"
    return [
        policy,
        str(side["requests"]),
        _pct(side["hit_rate"]),
        _pct(side["follow_ups"]["hit_rate"]),
        _ms(side["ttft_p50_s"]),
        _ms(side["ttft_p99_s"]),
        _ms(side["follow_up_ttft_p50_s"]),
        _num(side["completion_tok_s"]),
        _num(side["requests_per_s"]),
        per_worker,
        reasons,
        str(len(side["errors"])),
    ]


def table_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    return HEADER, [_row(policy, side) for policy, side in result["policies"].items()]
