"""The soak's judgement (services/bench/soak/samples.py) on synthetic series: the Theil-Sen slope shrugs
off outliers a least-squares line would follow, a steady climb over the bar is flagged while the same
noise around a flat line is not, the warm-up is left out, and fds or threads that keep rising are growth."""

from __future__ import annotations

import random

import pytest

from services.bench.soak.samples import MB, Series, connections_verdict, process_verdict, theil_sen


def test_theil_sen_ignores_outliers() -> None:
    ts = [float(t) for t in range(20)]
    ys = [2.0 * t + 5 for t in ts]
    ys[3], ys[17] = 1000.0, -1000.0
    assert theil_sen(ts, ys) == pytest.approx(2.0)
    assert theil_sen([1.0], [1.0]) == 0.0


def _series(rss_per_s: float, *, warmup_jump: float = 0.0, fds_step_s: float | None = None) -> Series:
    rng = random.Random(1)
    series = Series()
    for i in range(60):  # a sample every 10 s for 10 minutes
        t = 10.0 * i
        rss = 200 * MB + rss_per_s * t + rng.uniform(-2, 2) * MB + (warmup_jump if t >= 120 else 0)
        fds = 40 + (int(t // fds_step_s) if fds_step_s else rng.choice((0, 1)))
        sample = {"rss": int(rss), "fds": fds, "threads": 12}
        series.add(t, {"codec": sample}, {"codec_client_connections": rng.choice((0, 1, 2))})
    return series


def test_a_steady_climb_is_flagged_and_noise_is_not() -> None:
    flat = process_verdict(_series(0.0), "codec", warmup_s=120)
    assert flat["ok"] is True and flat["rss_growing"] is False
    assert flat["rss_bar_mb_per_10_min"] == pytest.approx(1.5)  # 0.5% of 200 MB is under the floor
    leaking = process_verdict(_series(10 * 1024), "codec", warmup_s=120)  # 10 KB/s = ~5.9 MB / 10 min
    assert leaking["rss_growing"] is True and leaking["why"] == "rss"
    assert leaking["rss_slope_mb_per_10_min"] == pytest.approx(5.86, rel=0.2)


def test_the_warm_up_is_left_out() -> None:
    assert process_verdict(_series(0.0, warmup_jump=50 * MB), "codec", warmup_s=120)["ok"] is True
    assert process_verdict(_series(0.0, warmup_jump=50 * MB), "codec", warmup_s=0)["rss_growing"] is True


def test_rising_fds_are_growth_and_connections_are_judged() -> None:
    verdict = process_verdict(_series(0.0, fds_step_s=60), "codec", warmup_s=120)
    assert verdict["ok"] is False and verdict["why"] == "fds"
    assert connections_verdict(_series(0.0), warmup_s=120)["ok"] is True


def test_too_few_samples_is_no_verdict() -> None:
    assert process_verdict(_series(0.0), "codec", warmup_s=590)["ok"] is False
