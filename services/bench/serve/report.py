"""The table and the PNG plots of `kvrelay bench serve` (summary.py says what each number is).

Plots (drawn by services/bench/plots.py): latency CDFs (TTFT, TPOT, ITL, e2e; a line per protocol, or
per tenant for two tenants, or per load of a sweep) at `--plot`; with `--sweep`, throughput and latency
against the offered load at `<plot stem>-load.png`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services.bench import plots
from services.bench.serve.clients import RequestRecord
from services.bench.serve.summary import itls_s, tpot_s

HEADER = [
    "load", "group", "ok/cxl/err/to", "TTFT p50/p90/p99 ms", "TPOT p50/p90/p99 ms", "ITL p50/p99 ms",
    "e2e p50/p99 ms", "req/s", "out tok/s", "goodput", "hit rate",
]  # fmt: skip


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


def _values(records: list[dict[str, Any]], metric: str) -> list[float]:
    """The seconds one CDF line plots: TTFT of every request that did not fail, the rest of `ok` ones."""
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


def title(result: dict[str, Any]) -> str:
    return (
        f"kvrelay bench serve: {result['workload']} workload, {result['protocol']} protocol, "
        f"{result['arrival']} arrivals, max_tokens {result['max_tokens']}, {result['model']}"
    )


def plot_cdfs(result: dict[str, Any], path: Path) -> None:
    lines = {
        name: {metric: _values(records, metric) for _, metric in plots.SERVE_METRICS}
        for name, records in _series(result).items()
    }
    plots.plot_serve_cdfs(lines, title(result), path)


def plot_load(result: dict[str, Any], path: Path) -> None:
    plots.plot_serve_load(result, title(result), path)


def load_plot_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}-load{path.suffix or '.png'}")
