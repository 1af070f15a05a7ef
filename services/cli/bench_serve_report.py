"""The table and the PNG plots of `kvrelay bench serve` (bench_serve_stats.py says what each number is).

Plots: latency CDFs (TTFT, TPOT, ITL, e2e; a line per protocol, or per tenant for two tenants, or per
load of a sweep) at `--plot`; with `--sweep`, throughput and latency against the offered load at
`<plot stem>-load.png`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.cli.bench_serve_stats import cdf_points, itls_s, tpot_s

HEADER = [
    "load", "group", "ok/cxl/err/to", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "ITL p50/p99 ms",
    "e2e p50/p99 ms", "req/s", "out tok/s", "goodput", "hit rate",
]  # fmt: skip
METRICS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("e2e", "e2e"))


def _ms(dist: dict[str, Any], *keys: str) -> str:
    return "/".join("-" if dist[k] is None else f"{dist[k]:.0f}" for k in keys)


def _row(load: str, group: str, s: dict[str, Any]) -> list[str]:
    hit = "-" if s["prefix_hit_rate"] is None else f"{100 * s['prefix_hit_rate']:.1f}%"
    return [
        load,
        group,
        f"{s['completed']}/{s['cancelled']}/{s['errors']}/{s['timeouts']}",
        _ms(s["ttft_ms"], "p50", "p90", "p99"),
        _ms(s["tpot_ms"], "p50", "p90", "p99"),
        _ms(s["itl_ms"], "p50", "p99"),
        _ms(s["e2e_ms"], "p50", "p99"),
        f"{s['requests_per_s']:.2f}",
        f"{s['output_tok_s']:.1f}",
        f"{s['goodput_rps']:.2f}",
        hit,
    ]


def breakdown(run: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The one grouping worth showing: tenants if several, else protocols if several, else kinds."""
    for name in ("by_tenant", "by_protocol", "by_kind"):
        if len(run[name]) > 1:
            return name, run[name]
    return "by_kind", run["by_kind"]


def table_rows(result: dict[str, Any]) -> list[list[str]]:
    rows = []
    for run in result["runs"]:
        rows.append(_row(run["load"], "all", run["summary"]))
        for group_by in ("by_protocol", "by_kind", "by_tenant"):
            if len(run[group_by]) > 1:
                rows += [_row(run["load"], name, side) for name, side in run[group_by].items()]
    return rows


def format_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER, *rows]) for i in range(len(HEADER))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in [HEADER, *rows]
    )


def _values(records: list[dict[str, Any]], metric: str) -> list[float]:
    from services.cli.bench_serve_clients import RequestRecord

    out: list[float] = []
    for body in records:
        r = RequestRecord(**body)
        if metric == "ttft" and r.ttft_s is not None and r.status != "error":
            out.append(r.ttft_s)
        elif r.status != "ok":
            continue
        elif metric == "tpot" and (t := tpot_s(r)) is not None:
            out.append(t)
        elif metric == "itl":
            out += itls_s(r)
        elif metric == "e2e" and r.e2e_s is not None:
            out.append(r.e2e_s)
    return out


def _series(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Records per CDF line: per run (its label, else its load), else per tenant, protocol or kind."""
    runs = result["runs"]
    if len(runs) > 1:
        return {run.get("label") or f"load {run['load']}": run["requests"] for run in runs}
    group_by, groups = breakdown(runs[0])
    field = {"by_tenant": "tenant", "by_protocol": "protocol", "by_kind": "kind"}[group_by]
    return {name: [r for r in runs[0]["requests"] if r[field] == name] for name in groups}


def plot_cdfs(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    for ax, (title, metric) in zip(axes, METRICS, strict=True):
        for name, records in _series(result).items():
            xs, ys = cdf_points(_values(records, metric))
            if xs:
                ax.step([xs[0], *xs], [0.0, *ys], where="post", label=f"{name} (n={len(xs)})")
        _log_ms_axis(ax, LogLocator, FuncFormatter, NullFormatter)
        ax.set_xlabel("ms")
        ax.set_title(f"{title} CDF", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(_title(result), fontsize=10)
    _save(fig, path)


def _ms_label(value: float) -> str:
    return f"{value / 1000:g}k" if value >= 1000 else f"{value:g}"


def _log_ms_axis(ax: Any, locator: Any, formatter: Any, null: Any) -> None:
    """A log x axis in ms, ticks at 1-2-5 steps (decades only when the range spans over 2.5 of them)."""
    ax.set_xscale("log")
    low, high = ax.get_xlim()
    wide = high / max(low, 1e-9) > 300
    ax.xaxis.set_major_locator(locator(base=10, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(formatter(lambda v, _: _ms_label(v)))
    ax.xaxis.set_minor_formatter(null())


def plot_load(result: dict[str, Any], path: Path) -> None:
    """Throughput (req/s, goodput, output tok/s) and TTFT/TPOT p50/p99 against the offered load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    xs = [float(run["load"]) for run in runs]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for key, label in (("requests_per_s", "completed req/s"), ("goodput_rps", "goodput req/s")):
        axes[0].plot(xs, [run["summary"][key] for run in runs], marker="o", label=label)
    axes[1].plot(xs, [run["summary"]["output_tok_s"] for run in runs], marker="o", label="output tok/s")
    for metric in ("ttft_ms", "tpot_ms"):
        for q in ("p50", "p99"):
            axes[2].plot(xs, [run["summary"][metric][q] for run in runs], marker="o", label=f"{metric} {q}")
    axes[2].set_yscale("log")
    unit = "concurrency" if result["arrival"] == "closed" else "offered jobs/s"
    for ax, title in zip(axes, ("requests/s", "output tokens/s", "latency (ms)"), strict=True):
        ax.set_xlabel(unit)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(result), fontsize=10)
    _save(fig, path)


def _title(result: dict[str, Any]) -> str:
    return (
        f"kvrelay bench serve: {result['workload']} workload, {result['protocol']} protocol, "
        f"{result['arrival']} arrivals, max_tokens {result['max_tokens']}, {result['model']}"
    )


def _save(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def load_plot_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}-load{path.suffix or '.png'}")
