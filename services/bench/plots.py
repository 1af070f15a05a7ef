"""Every chart the benchmarks draw, as PNG files. matplotlib (the `bench` extra) is imported only when a
chart is drawn, with the Agg backend, so no display is needed.

The benchmarks pass their results in; nothing here measures or computes a statistic beyond `cdf_points`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from services.bench.stats import cdf_points

Series = Mapping[str, Sequence[float | None]]
SERVE_METRICS = (("TTFT", "ttft"), ("TPOT", "tpot"), ("ITL", "itl"), ("e2e", "e2e"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, path: Path, dpi: int) -> None:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)


def _grouped_bars(ax: Any, labels: Sequence[str], series: Series, fmt: str, *, label_size: int = 8,
                  tick_size: int | None = None, headroom: bool = False) -> None:  # fmt: skip
    """One group of bars per label, one bar per series in it; a missing or non-finite value is 0."""
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        xs = [j + i * width for j in range(len(labels))]
        heights = [v if v is not None and math.isfinite(v) else 0 for v in values]
        ax.bar_label(ax.bar(xs, heights, width, label=name), fmt=fmt, fontsize=label_size)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(labels))], labels, fontsize=tick_size)
    if headroom:  # room for the legend above the bars
        top = max((v for values in series.values() for v in values if v is not None), default=0.0)
        ax.set_ylim(0, 1.25 * top or 1.0)
    ax.legend(fontsize=8, loc="upper right" if headroom else "best")


def _scaled(values: Sequence[float | None], factor: float) -> list[float | None]:
    return [None if v is None else factor * v for v in values]


def line_chart(xs: Sequence[float], series: Series, xlabel: str, ylabel: str, title: str, path: Path) -> None:
    """One line per series over `xs` (log-scaled x), markers at the points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in series.items():
        ax.plot(xs, values, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    _save(fig, path, 110)


# -- bench engine --------------------------------------------------------------------------------------


def plot_engine(result: dict[str, Any], batches: list[int], path: Path) -> None:
    """Decode tok/s per batch size for each side, and prefill tok/s."""
    plt = _pyplot()
    sides: list[str] = result.get("sides") or [s for s in ("kvrelay", "transformers") if s in result]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    decode: dict[str, list[float | None]] = {
        side: [result[side]["decode"].get(str(b), {}).get("tok_s") for b in batches] for side in sides
    }
    _grouped_bars(ax1, [str(b) for b in batches], decode, "%.0f")
    ax1.set_xlabel("concurrent sequences")
    ax1.set_ylabel("decode tok/s (prefill excluded)")
    ax1.set_title(
        f"decode, {result['threads']} threads\nkvrelay: {result['precision']}; transformers: bfloat16"
    )
    bars = ax2.bar(
        sides, [result[s]["prefill_tok_s"] for s in sides], color=[f"C{i}" for i in range(len(sides))]
    )
    ax2.bar_label(bars, fmt="%.0f", fontsize=8)
    ax2.set_ylabel(f"prefill tok/s ({result['prefill_tokens']}-token prompt)")
    ax2.set_title("prefill")
    _save(fig, path, 110)


def plot_grammar(result: dict[str, Any], path: Path) -> None:
    """Decode tok/s per batch size, free and under the JSON schema."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    batches = list(result["batches"])
    series: dict[str, list[float | None]] = {
        "free text": [result["batches"][b]["free_tok_s"] for b in batches],
        "JSON schema": [result["batches"][b]["schema_tok_s"] for b in batches],
    }
    _grouped_bars(ax, batches, series, "%.0f", headroom=True)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"structured output, {result['new_tokens']} tokens each")
    _save(fig, path, 110)


# -- bench stack ---------------------------------------------------------------------------------------


def plot_stack(result: dict[str, Any], path: Path) -> None:
    """Decode tok/s of the stack, the engine alone and transformers at one concurrency (medians, with
    each round's value as a dot), and the stack's TTFT of the last stream to start, per round."""
    plt = _pyplot()
    c = str(result["concurrency"])
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2, 1]})
    sides = {
        "kvrelay stack": [r["decode_tok_s"] for r in result["stack"]["rounds"]],
        "engine alone": [r["tok_s"] for r in result["engine"]["rounds"]],
    }
    medians = [result["stack"]["decode_tok_s"], result["engine"]["decode"][c]["tok_s"]]
    if "peer" in result:
        sides[result["peer"]["name"]] = [r["decode_tok_s"] for r in result["peer"]["rounds"]]
        medians.append(result["peer"]["decode_tok_s"])
    if "transformers" in result:
        sides["transformers bf16"] = [result["transformers"]["decode"][c]["tok_s"]]
        medians.append(result["transformers"]["decode"][c]["tok_s"])
    names = list(sides)
    bars = ax1.bar(names, medians, color=[f"C{i}" for i in range(len(names))])
    ax1.bar_label(bars, fmt="%.0f", fontsize=8)
    for i, values in enumerate(sides.values()):
        ax1.plot([i] * len(values), values, "k.", markersize=5)
    ax1.set_ylabel("decode tok/s (all streams)")
    ax1.set_title(f"concurrency {c}, {result['new_tokens']} tokens per stream; dots: rounds")
    ttfts = [r["ttft_ms_max"] for r in result["stack"]["rounds"]]
    ax2.bar_label(ax2.bar([str(i + 1) for i in range(len(ttfts))], ttfts, color="C0"), fmt="%.0f", fontsize=8)
    ax2.set_xlabel("round")
    ax2.set_ylabel("ms until every stream had its first token")
    ax2.set_title("stack TTFT (last stream)")
    _save(fig, path, 110)


# -- bench serve ---------------------------------------------------------------------------------------


def _ms_label(value: float) -> str:
    return f"{value / 1000:g}k" if value >= 1000 else f"{value:g}"


def _log_ms_axis(ax: Any) -> None:
    """A log x axis in ms, ticks at 1-2-5 steps (decades only when the range spans over 2.5 of them)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    low, high = ax.get_xlim()
    wide = high / max(low, 1e-9) > 300
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0,) if wide else (1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _ms_label(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def plot_serve_cdfs(lines: Mapping[str, Mapping[str, list[float]]], title: str, path: Path) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, e2e), one line per entry of `lines` (metric -> values in s)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(17, 4.2))
    for ax, (name, metric) in zip(axes, SERVE_METRICS, strict=True):
        for label, values in lines.items():
            xs, ys = cdf_points(values[metric])
            if xs:
                ax.step([xs[0], *xs], [0.0, *ys], where="post", label=f"{label} (n={len(xs)})")
        _log_ms_axis(ax)
        ax.set_xlabel("ms")
        ax.set_title(f"{name} CDF", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_ylabel("fraction of requests")
    fig.suptitle(title, fontsize=10)
    _save(fig, path, 100)


def plot_serve_load(result: dict[str, Any], title: str, path: Path) -> None:
    """Throughput (req/s, goodput, output tok/s) and TTFT/TPOT p50/p99 against the offered load."""
    plt = _pyplot()
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
    for ax, name in zip(axes, ("requests/s", "output tokens/s", "latency (ms)"), strict=True):
        ax.set_xlabel(unit)
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    _save(fig, path, 100)


# -- bench routing -------------------------------------------------------------------------------------


def plot_routing(result: dict[str, Any], path: Path) -> None:
    """Three panels per policy: prefix hit rate, TTFT p50/p99, throughput."""
    plt = _pyplot()
    sides = result["policies"]
    labels = list(sides)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    hit = {
        "all turns": _scaled([s["hit_rate"] for s in sides.values()], 100),
        "follow-ups": _scaled([s["follow_ups"]["hit_rate"] for s in sides.values()], 100),
    }
    _grouped_bars(axes[0], labels, hit, "%.1f", headroom=True)
    axes[0].set_ylabel("cached / prompt tokens (%)")
    axes[0].set_title("prefix hit rate", fontsize=10)
    ttft = {
        "p50": _scaled([s["ttft_p50_s"] for s in sides.values()], 1000),
        "p99": _scaled([s["ttft_p99_s"] for s in sides.values()], 1000),
    }
    _grouped_bars(axes[1], labels, ttft, "%.0f", headroom=True)
    axes[1].set_ylabel("ms at the client")
    axes[1].set_title("TTFT", fontsize=10)
    throughput = {"completion tok/s": [s["completion_tok_s"] for s in sides.values()]}
    _grouped_bars(axes[2], labels, throughput, "%.1f", headroom=True)
    axes[2].set_ylabel("completion tokens / s over the wall time")
    axes[2].set_title("throughput", fontsize=10)
    w = result["workload"]
    fig.suptitle(
        f"kvrelay bench routing: {result['workers']} workers, {w['sessions']} sessions x {w['turns']} turns, "
        f"session key: {w['session']}"
    )
    _save(fig, path, 110)


# -- bench kv-tiers ------------------------------------------------------------------------------------


def plot_kv_tiers(result: dict[str, Any], path: Path) -> None:
    """Per phase (warm, restart, rescale), one bar per side: TTFT p50, TTFT p99 and the prefix hit rate."""
    plt = _pyplot()
    sides = result["sides"]
    phases = list(next(iter(sides.values()))) if sides else []
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.5))
    for ax, key, scale, unit in (
        (axes[0], "ttft_p50_s", 1000, "TTFT p50 (ms)"),
        (axes[1], "ttft_p99_s", 1000, "TTFT p99 (ms)"),
        (axes[2], "hit_rate", 100, "cached / prompt tokens (%)"),
    ):
        series = {
            side: _scaled([by_phase[p][key] for p in phases], scale) for side, by_phase in sides.items()
        }
        _grouped_bars(ax, phases, series, "%.0f", headroom=True)
        ax.set_ylabel(unit)
    w = result["workload"]
    what = (
        "busy = worker-0 hogged, last turn; aware/unaware = router.tier_aware"
        if result.get("scenario") == "busy"
        else "restart = worker-0 killed, rescale = worker-1 added (round-robin)"
    )
    fig.suptitle(f"kvrelay bench kv-tiers: {w['sessions']} sessions x {w['turns']} turns; {what}")
    _save(fig, path, 110)


# -- bench transfer ------------------------------------------------------------------------------------


def plot_transfer(result: dict[str, Any], path: Path) -> None:
    """Transfer shares, first and second token latency, and short-request TTFT under load (when the load
    was measured: `--load-seconds 0` draws the first two only)."""
    plt = _pyplot()
    with_load = bool(result["load"]["sides"])
    fig, axes = plt.subplots(1, 3 if with_load else 2, figsize=(16 if with_load else 11, 4.5))
    _transfer_shares(axes[0], result)
    _transfer_latency(axes[1], result)
    if with_load:
        _transfer_load(axes[2], result)
    fig.suptitle(f"kvrelay bench transfer: {Path(result['model']).name}, {result['dtype']}, loopback")
    _save(fig, path, 110)


def _transfer_shares(ax: Any, result: dict[str, Any]) -> None:
    labels: list[str] = []
    series: dict[str, list[float | None]] = {"xfer / time to 2nd token": [], "xfer / TTFT": []}
    for transport, entry in result["transfer"].items():
        for length, s in entry.get("lengths", {}).items() if entry["status"] == "ok" else []:
            labels.append(f"{transport}\n{length} tok")
            series["xfer / time to 2nd token"].append(s["transfer_share_of_second_token"])
            series["xfer / TTFT"].append(s["transfer_share_of_ttft"])
    _grouped_bars(ax, labels, series, "%.2f", label_size=7, tick_size=8)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("kv_transfer_seconds / client latency")
    ax.set_title("transfer share (xfer includes P's prefill;\n1st token leaves before the KV)", fontsize=9)


def _transfer_latency(ax: Any, result: dict[str, Any]) -> None:
    labels: list[str] = []
    series: dict[str, list[float | None]] = {"TTFT": [], "2nd token": []}
    sides = [(t, e.get("lengths", {})) for t, e in result["transfer"].items() if e["status"] == "ok"]
    for side, lengths in [*sides, ("colocated", result["colocated"])]:
        for length, s in lengths.items():
            labels.append(f"{side}\n{length} tok")
            series["TTFT"].append(1000 * s["ttft_s"])
            series["2nd token"].append(1000 * s["time_to_second_token_s"])
    _grouped_bars(ax, labels, series, "%.0f", label_size=7, tick_size=8)
    ax.set_ylabel("ms at the client")
    ax.set_title("first and second token, one request at a time", fontsize=9)


def _transfer_load(ax: Any, result: dict[str, Any]) -> None:
    sides = result["load"]["sides"]
    labels = [side.replace(", ", ",\n").replace(" (", "\n(") for side in sides]
    series = {
        "short TTFT p50": [1000 * load["short"]["ttft_p50_s"] for load in sides.values()],
        "short TTFT p99": [1000 * load["short"]["ttft_p99_s"] for load in sides.values()],
        "long TTFT p50": [1000 * load["long"]["ttft_p50_s"] for load in sides.values()],
    }
    _grouped_bars(ax, labels, series, "%.0f", label_size=7, tick_size=8)
    plan = result["load"]["plan"]
    ax.set_ylabel("ms at the client")
    ax.set_title(
        f"{plan['short_tokens']}-token requests while {plan['long_tokens']}-token prompts arrive", fontsize=9
    )


# -- bench soak ----------------------------------------------------------------------------------------


def plot_soak(result: dict[str, Any], path: Path) -> None:
    """RSS per process over the run (the warm-up's end marked), and the codec's client connections."""
    plt = _pyplot()
    series = result["series"]
    minutes = [t / 60 for t in series["t_s"]]
    fig, (rss_ax, conn_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(3, 1))
    for name, samples in series["processes"].items():
        rss_ax.plot(minutes, [None if s is None else s["rss"] / 2**20 for s in samples], label=name)
    verdicts = result["verdict"]["processes"]
    slopes = ", ".join(f"{n} {v.get('rss_slope_mb_per_10_min', 'n/a')}" for n, v in verdicts.items())
    rss_ax.set_ylabel("RSS (MB)")
    rss_ax.set_title(f"RSS slope after warm-up, MB per 10 min: {slopes}", fontsize=8)
    rss_ax.legend(fontsize=8)
    conn_ax.plot(minutes, [None if s is None else s["codec_client_connections"] for s in series["stack"]])
    conn_ax.set_ylabel("codec connections")
    conn_ax.set_xlabel("minutes")
    for ax in (rss_ax, conn_ax):
        ax.axvline(result["config"]["warmup_s"] / 60, color="grey", linestyle="--", linewidth=0.8)
    _save(fig, path, 110)
