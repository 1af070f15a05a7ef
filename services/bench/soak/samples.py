"""What `kvrelay bench soak` samples and how it judges the samples.

Every `--sample-s` seconds: each process's resident memory, open file descriptors and threads (psutil,
by PID), and the stack's own end-state readings (services/bench/admission/flood.py `end_state`: the
codec's client connections, running and queued requests and open quota reservations, the worker's
running and waiting requests and active KV blocks).

The verdict looks only at samples after the warm-up. For each process, the Theil-Sen slope of its RSS
(the median of the slopes between every pair of samples: one burst of allocation or a GC pause cannot
tilt it the way it tilts a least-squares line), scaled to bytes per 10 minutes, must stay under the
larger of RSS_SHARE of its median RSS and RSS_FLOOR_BYTES. File descriptors, threads and client
connections must be flat: their Theil-Sen slope under COUNT_SLOPE_MAX per 10 minutes. numpy computes
the pairwise slopes; scipy's `theilslopes` does the same but would be the bench's only use of scipy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil

TEN_MINUTES_S = 600.0
RSS_SHARE = 0.005
RSS_FLOOR_BYTES = 1.5 * 2**20
COUNT_SLOPE_MAX = 1.0  # per 10 minutes: one more fd, thread or connection every 10 minutes is growth
MB = 2**20


def theil_sen(ts: Sequence[float], ys: Sequence[float]) -> float:
    """The median slope over every pair of points with distinct times (0.0 with fewer than two)."""
    t, y = np.asarray(ts, dtype=float), np.asarray(ys, dtype=float)
    i, j = np.triu_indices(len(t), k=1)
    dt = t[j] - t[i]
    keep = dt > 0
    return float(np.median((y[j] - y[i])[keep] / dt[keep])) if keep.any() else 0.0


def process_sample(pid: int) -> dict[str, int] | None:
    """RSS bytes, open fds and threads of `pid`; None once it is gone."""
    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            return {"rss": proc.memory_info().rss, "fds": proc.num_fds(), "threads": proc.num_threads()}
    except psutil.Error:
        return None


@dataclass
class Series:
    """Samples over time: per process (rss, fds, threads) and the stack's readings."""

    t: list[float] = field(default_factory=list)
    processes: dict[str, list[dict[str, int] | None]] = field(default_factory=dict)
    stack: list[dict[str, Any] | None] = field(default_factory=list)  # None: the readings failed

    def add(
        self, t: float, processes: dict[str, dict[str, int] | None], stack: dict[str, Any] | None
    ) -> None:
        self.t.append(round(t, 2))
        for name, sample in processes.items():
            self.processes.setdefault(name, []).append(sample)
        self.stack.append(stack)

    def as_json(self) -> dict[str, Any]:
        return {"t_s": self.t, "processes": self.processes, "stack": self.stack}


def _window(series: Series, warmup_s: float, values: Sequence[Any]) -> tuple[list[float], list[Any]]:
    pairs = [(t, v) for t, v in zip(series.t, values, strict=True) if t >= warmup_s and v is not None]
    return [t for t, _ in pairs], [v for _, v in pairs]


def _per_10_min(ts: Sequence[float], ys: Sequence[float]) -> float:
    return theil_sen(ts, ys) * TEN_MINUTES_S


def process_verdict(series: Series, name: str, warmup_s: float) -> dict[str, Any]:
    """One process's slopes over the measured window and whether each stays under its bar."""
    ts, samples = _window(series, warmup_s, series.processes[name])
    if len(ts) < 3:
        return {"samples": len(ts), "ok": False, "why": "fewer than 3 samples after the warm-up"}
    rss = [s["rss"] for s in samples]
    rss_slope = _per_10_min(ts, rss)
    bar = max(RSS_SHARE * float(np.median(rss)), RSS_FLOOR_BYTES)
    counts = {k: _per_10_min(ts, [s[k] for s in samples]) for k in ("fds", "threads")}
    growing = [k for k, slope in counts.items() if slope >= COUNT_SLOPE_MAX]
    rss_ok = rss_slope < bar
    return {
        "samples": len(ts),
        "rss_mb_first_last": [round(rss[0] / MB, 1), round(rss[-1] / MB, 1)],
        "rss_slope_mb_per_10_min": round(rss_slope / MB, 3),
        "rss_bar_mb_per_10_min": round(bar / MB, 3),
        "fds_first_last": [samples[0]["fds"], samples[-1]["fds"]],
        "threads_first_last": [samples[0]["threads"], samples[-1]["threads"]],
        "count_slopes_per_10_min": {k: round(v, 2) for k, v in counts.items()},
        "rss_growing": not rss_ok,
        "ok": rss_ok and not growing,
        "why": None if rss_ok and not growing else ", ".join((["rss"] if not rss_ok else []) + growing),
    }


def connections_verdict(series: Series, warmup_s: float) -> dict[str, Any]:
    ts, states = _window(series, warmup_s, series.stack)
    values = [s["codec_client_connections"] for s in states]
    slope = _per_10_min(ts, values) if len(values) >= 3 else 0.0
    return {"slope_per_10_min": round(slope, 2), "max": max(values, default=0), "ok": slope < COUNT_SLOPE_MAX}
