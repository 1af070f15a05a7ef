"""The tables `kvrelay bench transfer` prints (command.py says what each number is; plots.py draws the
chart)."""

from __future__ import annotations

import math
from typing import Any

from services.bench.tables import format_table

TRANSFER_HEADER = [
    "side", "prompt", "KV MB/req", "KB/token", "xfer ms", "TTFT ms", "2nd tok ms", "gap ms", "ITL ms",
    "xfer/2nd", "xfer/TTFT", "mode",
]  # fmt: skip
LOAD_HEADER = [
    "side", "short n", "TTFT p50 ms", "TTFT p99 ms", "short on P", "long n", "long TTFT p50 ms", "long on P",
    "errors",
]  # fmt: skip


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or not math.isfinite(seconds) else f"{1000 * seconds:.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.2f}"


def _transfer_row(side: str, length: str, s: dict[str, Any], remote: bool) -> list[str]:
    return [
        side,
        length,
        f"{s['kv_bytes'] / 1e6:.1f}" if remote else "-",
        f"{s['kv_bytes_per_token'] / 1e3:.1f}" if remote else "-",
        _ms(s["kv_transfer_s"]) if remote else "-",
        _ms(s["ttft_s"]),
        _ms(s["time_to_second_token_s"]),
        _ms(s["gap_first_to_second_s"]),
        _ms(s["inter_token_s"]),
        _ratio(s["transfer_share_of_second_token"]) if remote else "-",
        _ratio(s["transfer_share_of_ttft"]) if remote else "-",
        ",".join(s["prefill_modes"]),
    ]


def transfer_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """The transfer table, and a note per skipped transport."""
    rows: list[list[str]] = []
    notes: list[str] = []
    for transport, entry in result["transfer"].items():
        if entry["status"] != "ok":
            notes.append(f"{transport}: skipped: {entry['reason']}")
            continue
        for length, s in entry["lengths"].items():
            rows.append(_transfer_row(transport, length, s, True))
            if "cross_kv_bytes" in s:  # an encoder-decoder model: the encoder output went instead
                notes.append(
                    f"{transport}, source of {length}: shipped the encoder output, "
                    f"{s['kv_bytes'] / 1e6:.2f} MB; "
                    f"its cross KV would be {s['cross_kv_bytes'] / 1e6:.2f} MB "
                    f"({s['cross_kv_bytes_over_shipped']:.1f}x)"
                )
    for length, s in result["colocated"].items():
        rows.append(_transfer_row("colocated", length, s, False))
    return TRANSFER_HEADER, rows, notes


def _on_p(summary: dict[str, Any]) -> str:
    """How many of the requests had their prompt prefilled on P (PREFILL_MODE_REMOTE)."""
    return f"{summary['prefill_modes'].get('REMOTE', 0)}/{summary['count']}"


def load_rows(result: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    rows = []
    for side, load in result["load"]["sides"].items():
        short, long = load["short"], load["long"]
        rows.append(
            [
                side,
                str(short["count"]),
                _ms(short["ttft_p50_s"]),
                _ms(short["ttft_p99_s"]),
                _on_p(short),
                str(long["count"]),
                _ms(long["ttft_p50_s"]),
                _on_p(long),
                str(len(load["errors"])),
            ]
        )
    return LOAD_HEADER, rows


def print_result(result: dict[str, Any]) -> None:
    """The transfer table with its notes, then the load table (if the load was measured)."""
    threads = result["threads"]
    print(
        f"KV transfer on loopback, {result['dtype']}, median of {result['repeats']}; "
        f"P and D {threads['prefill']} thread(s) each, colocated {threads['colocated']}"
    )
    header, rows, notes = transfer_rows(result)
    print(format_table(header, rows))
    for note in notes:
        print(note)
    print(
        "xfer = kv_transfer_seconds (D: Prefill call start -> KV installed, includes P's prefill).\n"
        "xfer/2nd = share of the time to the 2nd token; xfer/TTFT > 1 because the 1st token is sent\n"
        "before the KV. gap = 1st->2nd token, ITL = later inter-token time: gap - ITL ~ shipping."
    )
    if result["load"]["sides"]:
        plan = result["load"]["plan"]
        print(
            f"\nshort requests ({plan['short_tokens']} tokens, {plan['short_new_tokens']} new, every "
            f"{plan['short_interval_s']} s for {plan['seconds']} s) while {plan['long_concurrency']} "
            f"x {plan['long_tokens']}-token prompts run back to back"
        )
        print(format_table(*load_rows(result)))
