"""Where a `--sweep` breaks, and which stage's queue grew first, from the stack's own readings.

While each load runs, `StageSampler` polls what the stack says about itself every STAGE_POLL_S: the
codec's admission queue (`kvrelay_admission_queued` on its /metrics: requests waiting for a concurrency
slot, before anything goes inward) and every other service's `waiting` in GET /status (the router's
requests not yet placed, each worker's engine queue). On a server that is not kvrelay, or one whose
/status needs a key the run does not have, there is nothing to read and the report says so.

`sweep_report` then names:
- `slo_breaks_at`: the first load whose p90 TTFT or p90 TPOT is over the SLO (`--slo-*`);
- `saturates_at`: the first load at which completed requests/s fall below SATURATION of what the load
  offered (`_rates`: measured from the run's own records, its drain tail and Poisson noise left out):
  past it, more load only queues;
- `first_queue`: the stage whose mean depth first reached QUEUE_GROWN as the load stepped up (ties: the
  deeper one), with every stage's first such load in order: the stage to scale out first;
- `stages_read`: which sources answered ("metrics": the codec's queue; "status": the router's and
  workers'), so a report that saw only the codec says so.
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
        self.sources: set[str] = set()  # "metrics" (the codec's queue), "status" (router and workers)

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
        if CODEC_QUEUE in depths:
            self.sources.add("metrics")
        if len(depths) > (CODEC_QUEUE in depths):
            self.sources.add("status")
        if depths:
            self.samples.append(depths)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sample()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), STAGE_POLL_S)

    def summary(self) -> dict[str, dict[str, float]] | None:
        """Each stage's mean and max depth over the samples that read it (a failed read is no zero)."""
        if not self.samples:
            return None
        stages = sorted({name for sample in self.samples for name in sample})
        out = {}
        for name in stages:
            values = [sample[name] for sample in self.samples if name in sample]
            out[name] = {"mean": round(sum(values) / len(values), 3), "max": max(values)}
        return out


def _over_slo(summary: dict[str, Any], slo: dict[str, float]) -> str | None:
    if summary["ttft_ms"]["p90"] is None:
        return "no request got a first token"
    for name, key in (("TTFT", "ttft"), ("TPOT", "tpot")):
        p90 = summary[f"{key}_ms"]["p90"]
        if p90 is not None and p90 > slo[f"{key}_ms"]:
            return f"p90 {name} {p90:.0f} ms > SLO {slo[f'{key}_ms']:g} ms"
    return None


def _jobs(run: dict[str, Any]) -> list[tuple[float, float, bool]]:
    """(start, end, whole) of each job in the run's records: a job arrives with its first turn and is done
    when its last turn ends; whole if every turn ended ok (or as the client's own cancel)."""
    jobs: dict[int, list[dict[str, Any]]] = {}
    for record in run.get("requests") or []:
        if record.get("start_s") is not None and record.get("job") is not None:
            jobs.setdefault(record["job"], []).append(record)
    out = []
    for turns in jobs.values():
        start = min(t["start_s"] for t in turns)
        end = max(t["start_s"] + (t.get("e2e_s") or 0.0) for t in turns)
        out.append((start, end, all(t.get("status") in ("ok", "cancelled") for t in turns)))
    return out


def _rates(runs: list[dict[str, Any]], i: int, closed: bool) -> tuple[float, float | None]:
    """(served, offered) jobs/s of run `i`, the unit of `--rate` (a multi-turn job's follow-ups wait on
    its replies, so requests/s would mix in the server's speed). From the run's records where the JSON
    has them: offered is the job arrival rate the run achieved (Poisson noise and all); served the whole
    jobs over the time from the first arrival to the last end, less the quickest job (the drain tail a
    run that keeps up still has). Else the summary's requests/s against the nominal load. A closed loop
    offers what its clients can send: the previous load's throughput scaled by the clients (nothing for
    the first)."""
    run = runs[i]
    served, offered = run["summary"]["requests_per_s"], float(run["load"])
    jobs = _jobs(run)
    whole = [(start, end) for start, end, ok in jobs if ok]
    if len(jobs) >= 2 and whole:
        starts = sorted(start for start, _, _ in jobs)
        span = max(end for _, end in whole) - starts[0] - min(end - start for start, end in whole)
        served = len(whole) / span if span > 0 else served
        if starts[-1] > starts[0]:
            offered = (len(jobs) - 1) / (starts[-1] - starts[0])
    if closed:
        if i == 0:
            return served, None
        previous, _ = _rates(runs, i - 1, closed)
        return served, previous * float(run["load"]) / float(runs[i - 1]["load"])
    return served, offered


def sweep_report(result: dict[str, Any]) -> dict[str, Any]:
    """Where the sweep's latency broke its SLO, where throughput stopped following the load, and which
    stage's queue grew first (None where the run does not tell)."""
    runs, closed = result["runs"], result["arrival"] == "closed"
    report: dict[str, Any] = {"slo_breaks_at": None, "saturates_at": None, "first_queue": None, "queues": []}
    for i, run in enumerate(runs):
        why = _over_slo(run["summary"], result["slo"])
        if why and report["slo_breaks_at"] is None:
            report["slo_breaks_at"] = {"load": run["load"], "why": why}
        served, offered = _rates(runs, i, closed)
        if offered and served < SATURATION * offered and report["saturates_at"] is None:
            report["saturates_at"] = {
                "load": run["load"],
                "served_rps": round(served, 3),
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
    sources = sorted({source for run in runs for source in run.get("stage_sources") or []})
    report["stages_read"] = sources
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
            f"throughput saturates at load {sat['load']} ({served:.2f} of {offered:.2f} jobs/s offered)"
        )
    else:
        lines.append("throughput follows the load at every step")
    if not report["stages_read"]:
        lines.append("stage queues: not read (no kvrelay /status and /metrics at --url, or no admin key)")
    elif "status" not in report["stages_read"]:
        lines.append(
            "stage queues: the codec's only (GET /status refused: the router's and workers' need admin)"
        )
    elif first is None:
        lines.append(f"no stage's queue reached a mean of {QUEUE_GROWN} waiting")
    else:
        order = ", then ".join(
            f"{q['stage']} at load {q['load']} (mean {q['mean_waiting']:.2f})" for q in report["queues"]
        )
        lines.append(f"first queue to grow: {order}")
    return lines
