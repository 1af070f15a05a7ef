"""Where a `--sweep` breaks, and which stage's queue grew first, from the stack's own readings.

While each load runs, `StageSampler` polls what the stack says about itself every STAGE_POLL_S: the
codec's admission queue (`kvrelay_admission_queued` on its /metrics: requests waiting for a concurrency
slot, before anything goes inward) and every other service's `waiting` in GET /status (the router's
requests not yet placed, each worker's engine queue). On a server that is not kvrelay, or one whose
/status needs a key the run does not have, there is nothing to read and the report says so.

`sweep_report` then names:
- `slo_breaks_at`: the first load whose p90 TTFT or p90 TPOT is over the SLO (`--slo-*`);
- `saturates_at`: the first load at which completed requests/s fall below SATURATION of what the load
  offered (open loop: the rate; closed loop: the previous load's throughput scaled by the concurrency):
  past it, more load only queues;
- `first_queue`: the stage whose mean depth first reached QUEUE_GROWN as the load stepped up (ties: the
  deeper one), with every stage's first such load in order: the stage to scale out first.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from typing import Any

import httpx

STAGE_POLL_S = 0.5
QUEUE_GROWN = 0.5  # mean requests waiting over the run: one waiting half the time
SATURATION = 0.8
CODEC_QUEUE = "codec admission"
_QUEUED = re.compile(r"^kvrelay_admission_queued (\S+)$", re.MULTILINE)


def stage_depths(status: dict[str, Any] | None, metrics: str | None) -> dict[str, float]:
    """Each stage's queue depth now: the codec's admission queue, every other service's `waiting`."""
    depths: dict[str, float] = {}
    found = _QUEUED.search(metrics or "")
    if found:
        depths[CODEC_QUEUE] = float(found.group(1))
    for service in (status or {}).get("services") or []:
        if isinstance(service, dict) and service.get("role") != "codec":
            depths[f"{service.get('name')} ({service.get('role')}) waiting"] = float(
                service.get("waiting") or 0
            )
    return depths


class StageSampler:
    """Polls the stack's stage depths until stopped; `summary` gives each stage's mean and max."""

    def __init__(self, client: httpx.AsyncClient, headers: dict[str, str]) -> None:
        self.client, self.headers = client, headers
        self.samples: list[dict[str, float]] = []

    async def _get(self, path: str) -> httpx.Response | None:
        try:
            response = await self.client.get(path, headers=self.headers, timeout=5.0)
        except httpx.HTTPError:
            return None
        return response if response.status_code == 200 else None

    async def sample(self) -> None:
        status, metrics = await asyncio.gather(self._get("/status"), self._get("/metrics"))
        try:
            document = status.json() if status is not None else None
        except ValueError:
            document = None
        depths = stage_depths(
            document if isinstance(document, dict) else None, metrics.text if metrics else None
        )
        if depths:
            self.samples.append(depths)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STAGE_POLL_S)

    def summary(self) -> dict[str, dict[str, float]] | None:
        if not self.samples:
            return None
        stages = sorted({name for sample in self.samples for name in sample})
        out = {}
        for name in stages:
            values = [sample.get(name, 0.0) for sample in self.samples]
            out[name] = {"mean": round(sum(values) / len(values), 3), "max": max(values)}
        return out


def _over_slo(summary: dict[str, Any], slo: dict[str, float]) -> str | None:
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot")):
        p90 = summary[f"{key}_ms"]["p90"]
        if p90 is not None and p90 > slo[f"{key}_ms"]:
            return f"p90 {name} {p90:.0f} ms > SLO {slo[f'{key}_ms']:g} ms"
    return None


def _offered(runs: list[dict[str, Any]], i: int, closed: bool) -> float | None:
    load = float(runs[i]["load"])
    if not closed:
        return load
    if i == 0:
        return None  # a closed loop offers what its clients can send: known only against a lighter load
    previous = runs[i - 1]
    return previous["summary"]["requests_per_s"] * load / float(previous["load"])


def sweep_report(result: dict[str, Any]) -> dict[str, Any]:
    """Where the sweep's latency broke its SLO, where throughput stopped following the load, and which
    stage's queue grew first (None where the run does not tell)."""
    runs, closed = result["runs"], result["arrival"] == "closed"
    report: dict[str, Any] = {"slo_breaks_at": None, "saturates_at": None, "first_queue": None, "queues": []}
    for i, run in enumerate(runs):
        why = _over_slo(run["summary"], result["slo"])
        if why and report["slo_breaks_at"] is None:
            report["slo_breaks_at"] = {"load": run["load"], "why": why}
        offered = _offered(runs, i, closed)
        served = run["summary"]["requests_per_s"]
        if offered and served < SATURATION * offered and report["saturates_at"] is None:
            report["saturates_at"] = {
                "load": run["load"],
                "served_rps": served,
                "offered_rps": round(offered, 3),
            }
    grown: list[tuple[int, float, str]] = []
    for name in sorted({n for run in runs for n in (run.get("stages") or {})}):
        for i, run in enumerate(runs):
            mean = ((run.get("stages") or {}).get(name) or {}).get("mean", 0.0)
            if mean >= QUEUE_GROWN:
                grown.append((i, -mean, name))
                break
    grown.sort()
    report["queues"] = [
        {"stage": name, "load": runs[i]["load"], "mean_waiting": -neg} for i, neg, name in grown
    ]
    report["first_queue"] = report["queues"][0] if grown else None
    report["stages_read"] = any(run.get("stages") for run in runs)
    return report


def report_lines(report: dict[str, Any]) -> list[str]:
    """The sweep report as sentences for the terminal."""
    slo, sat, first = report["slo_breaks_at"], report["saturates_at"], report["first_queue"]
    lines = ["latency within the SLO at every load"]
    if slo:
        lines = [f"latency breaks the SLO at load {slo['load']} ({slo['why']})"]
    if sat:
        served, offered = sat["served_rps"], sat["offered_rps"]
        lines.append(
            f"throughput saturates at load {sat['load']} ({served:.2f} of {offered:.2f} req/s offered)"
        )
    else:
        lines.append("throughput follows the load at every step")
    if not report["stages_read"]:
        lines.append("stage queues: not read (no kvrelay /status and /metrics at --url, or no admin key)")
    elif first is None:
        lines.append(f"no stage's queue reached a mean of {QUEUE_GROWN} waiting")
    else:
        order = ", then ".join(
            f"{q['stage']} at load {q['load']} (mean {q['mean_waiting']:.2f})" for q in report["queues"]
        )
        lines.append(f"first queue to grow: {order}")
    return lines
