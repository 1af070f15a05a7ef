"""The table and the PNG chart of `kvrelay bench routing` (see bench_routing.py for what each number is)."""

from __future__ import annotations

from pathlib import Path
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


def format_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]
    )


def _bars(ax: Any, labels: list[str], series: dict[str, list[float | None]], fmt: str) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(labels))]
        bars = ax.bar(xs, [0 if v is None else v for v in values], width, label=name)
        ax.bar_label(bars, fmt=fmt, fontsize=8)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))], labels)
    top = max((v for values in series.values() for v in values if v is not None), default=0.0)
    ax.set_ylim(0, 1.25 * top or 1.0)  # room for the legend above the bars
    ax.legend(fontsize=8, loc="upper right")


def _scaled(values: list[float | None], factor: float) -> list[float | None]:
    return [None if v is None else factor * v for v in values]


def plot(result: dict[str, Any], path: Path) -> None:
    """Three panels per policy: prefix hit rate, TTFT p50/p99, throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = result["policies"]
    labels = list(sides)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    hit = {
        "all turns": [s["hit_rate"] for s in sides.values()],
        "follow-ups": [s["follow_ups"]["hit_rate"] for s in sides.values()],
    }
    _bars(axes[0], labels, {k: _scaled(v, 100) for k, v in hit.items()}, "%.1f")
    axes[0].set_ylabel("cached / prompt tokens (%)")
    axes[0].set_title("prefix hit rate", fontsize=10)
    ttft = {
        "p50": _scaled([s["ttft_p50_s"] for s in sides.values()], 1000),
        "p99": _scaled([s["ttft_p99_s"] for s in sides.values()], 1000),
    }
    _bars(axes[1], labels, ttft, "%.0f")
    axes[1].set_ylabel("ms at the client")
    axes[1].set_title("TTFT", fontsize=10)
    _bars(axes[2], labels, {"completion tok/s": [s["completion_tok_s"] for s in sides.values()]}, "%.1f")
    axes[2].set_ylabel("completion tokens / s over the wall time")
    axes[2].set_title("throughput", fontsize=10)
    w = result["workload"]
    fig.suptitle(
        f"kvrelay bench routing: {result['workers']} workers, {w['sessions']} sessions x {w['turns']} turns, "
        f"session key: {w['session']}"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
