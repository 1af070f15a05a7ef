"""The `--sweep` report (services/bench/serve/stages.py) on synthetic runs: the first load over the SLO at
p90, the first load whose throughput falls behind what it offered, the stage whose queue grew first (and
the others in order), and what the stack's /status and /metrics give as stage depths."""

from __future__ import annotations

from typing import Any

import pytest

from services.bench.serve.stages import CODEC_QUEUE, report_lines, stage_depths, sweep_report

SLO = {"ttft_ms": 1000.0, "tpot_ms": 100.0}


def _run(load: str, rps: float, ttft_p90: float | None, stages: dict[str, float] | None) -> dict[str, Any]:
    summary = {"requests_per_s": rps, "ttft_ms": {"p90": ttft_p90}, "tpot_ms": {"p90": 50.0}}
    depth = (
        None if stages is None else {name: {"mean": mean, "max": mean * 2} for name, mean in stages.items()}
    )
    sources = [] if stages is None else ["metrics", "status"]
    return {"load": load, "summary": summary, "stages": depth, "stage_sources": sources}


def _result(runs: list[dict[str, Any]], arrival: str = "poisson") -> dict[str, Any]:
    return {"runs": runs, "slo": SLO, "arrival": arrival}


WORKER = "worker-0 (colocated) waiting"


def test_the_report_names_the_break_the_saturation_and_the_first_queue() -> None:
    report = sweep_report(_result([
        _run("1", 0.98, 300, {WORKER: 0.0, CODEC_QUEUE: 0.0}),
        _run("2", 1.9, 700, {WORKER: 1.4, CODEC_QUEUE: 0.1}),
        _run("4", 2.1, 2500, {WORKER: 6.0, CODEC_QUEUE: 2.0}),
    ]))  # fmt: skip
    assert report["slo_breaks_at"] == {"load": "4", "why": "p90 TTFT 2500 ms > SLO 1000 ms"}
    assert report["saturates_at"] == {"load": "4", "served_rps": 2.1, "offered_rps": 4.0}
    assert report["first_queue"] == {"stage": WORKER, "load": "2", "mean_waiting": 1.4}
    assert [q["stage"] for q in report["queues"]] == [WORKER, CODEC_QUEUE]
    lines = report_lines(report)
    assert lines[0].startswith("latency breaks the SLO at load 4")
    assert "first queue to grow: worker-0 (colocated) waiting at load 2" in lines[2]


def test_a_closed_loop_is_judged_against_the_previous_load_and_an_unread_stack_is_said() -> None:
    report = sweep_report(_result([_run("2", 2.0, 100, None), _run("8", 3.0, 200, None)], arrival="closed"))
    assert report["saturates_at"] == {"load": "8", "served_rps": 3.0, "offered_rps": 8.0}
    assert report["slo_breaks_at"] is None and report["first_queue"] is None
    assert report_lines(report)[0] == "latency within the SLO at every load"
    assert "not read" in report_lines(report)[2]


def test_rates_come_from_the_records_without_the_drain_tail_or_poisson_noise() -> None:
    """12 requests that arrived over 11 s (1.09/s, though the nominal load says 2) each done in 3 s: the
    run kept up, whatever its wall time of 14 s says. The same arrivals each done 2 s after the one
    before (a server at 0.5/s) saturate."""
    arrivals = [float(t) for t in range(12)]
    kept_up = [{"job": i, "start_s": t, "e2e_s": 3.0, "status": "ok"} for i, t in enumerate(arrivals)]
    behind = [
        {"job": i, "start_s": t, "e2e_s": 3.0 + 1.0 * i, "status": "ok"} for i, t in enumerate(arrivals)
    ]
    runs = [
        _run("2", 12 / 14, 100, None) | {"requests": kept_up},
        _run("4", 0.5, 100, None) | {"requests": behind},
    ]
    report = sweep_report(_result(runs))
    assert report["saturates_at"]["load"] == "4"
    assert report["saturates_at"]["offered_rps"] == pytest.approx(1.0)  # 11 gaps in 11 s


def test_a_load_where_nothing_got_a_token_breaks_the_slo() -> None:
    report = sweep_report(_result([_run("1", 1.0, 100, None), _run("2", 0.0, None, None)]))
    assert report["slo_breaks_at"] == {"load": "2", "why": "no request got a first token"}


def test_stage_depths_from_status_and_metrics() -> None:
    status = {"services": [
        {"name": "codec", "role": "codec", "waiting": 0},
        {"name": "router", "role": "router", "waiting": 3},
        {"name": "worker-0", "role": "colocated", "waiting": 5},
    ]}  # fmt: skip
    metrics = "# HELP x\nkvrelay_admission_queued 2.0\nkvrelay_admission_queued_total 9.0\n"
    assert stage_depths(status, metrics) == {
        CODEC_QUEUE: 2.0, "router (router) waiting": 3.0, WORKER: 5.0,
    }  # fmt: skip
    assert stage_depths(None, None) == {}
