"""`kvrelay canary`'s verdict (services/cli/canary.py): a canary fails on a 5xx share above the main
release's by more than the allowed delta, or on a p99 above the allowed ratio of the main's; with no canary
traffic there is nothing to judge; the table shows both side by side. (The queries themselves run against a
real Prometheus in tests/e2e/test_grey_release_codecs.py.)"""

from __future__ import annotations

from services.cli.canary import ReleaseFigures, queries, table, verdict


def figures(release: str, rps: float | None, errors: float | None, p99: float) -> ReleaseFigures:
    latency = {"ttft_p50": p99 / 4, "ttft_p99": p99 / 2, "e2e_p50": p99 / 3, "e2e_p99": p99}
    return ReleaseFigures(release, rps, errors, latency)


MAIN = figures("kvrelay", 10.0, 0.001, 2.0)


def test_a_canary_as_good_as_the_main_release_passes() -> None:
    assert verdict(MAIN, figures("next", 1.0, 0.005, 2.5), 0.01, 1.5) == ("pass", [])


def test_more_errors_than_allowed_fail_it_and_say_so() -> None:
    outcome, reasons = verdict(MAIN, figures("next", 1.0, 0.02, 2.0), 0.01, 1.5)
    assert outcome == "fail" and len(reasons) == 1 and reasons[0].startswith("5xx share 0.0200")


def test_a_slower_p99_fails_it() -> None:
    outcome, reasons = verdict(MAIN, figures("next", 1.0, 0.0, 3.5), 0.01, 1.5)
    assert outcome == "fail" and [r.split()[0] for r in reasons] == ["ttft_p99", "e2e_p99"]


def test_no_canary_traffic_is_no_verdict() -> None:
    assert verdict(MAIN, figures("next", 0.0, None, 0.0), 0.01, 1.5)[0] == "no_traffic"
    assert verdict(MAIN, figures("next", None, None, 0.0), 0.01, 1.5)[0] == "no_traffic"


def test_queries_select_each_release_by_its_codec_service() -> None:
    promql = queries("kvrelay-next", "5m", namespace="serving")
    assert 'service="kvrelay-next-codec",namespace="serving"' in promql["requests_per_s"]
    assert 'status=~"5.."' in promql["error_share"] and "[5m]" in promql["e2e_p99"]
    assert promql["ttft_p99"].startswith("histogram_quantile(0.99,")


def test_the_table_puts_the_two_side_by_side() -> None:
    lines = table(MAIN, figures("next", None, None, 1.0)).splitlines()
    assert lines[0].split() == ["kvrelay", "next"]
    assert lines[1].split() == ["requests/s", "10.000", "-"]
    assert lines[2].split() == ["5xx", "share", "0.10%", "-"]
