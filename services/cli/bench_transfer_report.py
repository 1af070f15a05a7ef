"""Tables and the PNG chart of `kvrelay bench transfer` (see bench_transfer.py for what each number is)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

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


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _plot_shares(axes[0], result)
    _plot_latency(axes[1], result)
    _plot_load(axes[2], result)
    fig.suptitle(f"kvrelay bench transfer: {Path(result['model']).name}, {result['dtype']}, loopback")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _grouped_bars(ax: Any, labels: list[str], series: dict[str, list[float]], fmt: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(labels))]
        bars = ax.bar(xs, [v if v is not None and math.isfinite(v) else 0 for v in values], width, label=name)
        ax.bar_label(bars, fmt=fmt, fontsize=7)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))], labels, fontsize=8)
    ax.legend(fontsize=8)


def _plot_shares(ax: Any, result: dict[str, Any]) -> None:
    labels: list[str] = []
    series: dict[str, list[float]] = {"xfer / time to 2nd token": [], "xfer / TTFT": []}
    for transport, entry in result["transfer"].items():
        for length, s in entry.get("lengths", {}).items() if entry["status"] == "ok" else []:
            labels.append(f"{transport}\n{length} tok")
            series["xfer / time to 2nd token"].append(s["transfer_share_of_second_token"])
            series["xfer / TTFT"].append(s["transfer_share_of_ttft"])
    _grouped_bars(ax, labels, series, "%.2f")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("kv_transfer_seconds / client latency")
    ax.set_title("transfer share (xfer includes P's prefill;\n1st token leaves before the KV)", fontsize=9)


def _plot_latency(ax: Any, result: dict[str, Any]) -> None:
    labels: list[str] = []
    series: dict[str, list[float]] = {"TTFT": [], "2nd token": []}
    sides = [(t, e.get("lengths", {})) for t, e in result["transfer"].items() if e["status"] == "ok"]
    for side, lengths in [*sides, ("colocated", result["colocated"])]:
        for length, s in lengths.items():
            labels.append(f"{side}\n{length} tok")
            series["TTFT"].append(1000 * s["ttft_s"])
            series["2nd token"].append(1000 * s["time_to_second_token_s"])
    _grouped_bars(ax, labels, series, "%.0f")
    ax.set_ylabel("ms at the client")
    ax.set_title("first and second token, one request at a time", fontsize=9)


def _plot_load(ax: Any, result: dict[str, Any]) -> None:
    sides = result["load"]["sides"]
    labels = [side.replace(", ", ",\n").replace(" (", "\n(") for side in sides]
    series = {
        "short TTFT p50": [1000 * load["short"]["ttft_p50_s"] for load in sides.values()],
        "short TTFT p99": [1000 * load["short"]["ttft_p99_s"] for load in sides.values()],
        "long TTFT p50": [1000 * load["long"]["ttft_p50_s"] for load in sides.values()],
    }
    _grouped_bars(ax, labels, series, "%.0f")
    plan = result["load"]["plan"]
    ax.set_ylabel("ms at the client")
    ax.set_title(
        f"{plan['short_tokens']}-token requests while {plan['long_tokens']}-token prompts arrive", fontsize=9
    )
