"""`kvrelay canary`: a grey release's two releases side by side, from their codecs' metrics in Prometheus.

During a canary (docs/deploy.md, "Grey release") the operator asks one question: is the new release worse
than the one it would replace? This reads, for each release, the codec's own series over `--window`
(the Prometheus Operator labels each scraped series with its Service, `<release>-codec`; `--namespace`
narrows it): requests per second (`kvrelay_requests_total`), the share that ended 5xx, and time to first
token and end-to-end latency at p50 and p99 (`histogram_quantile` over `kvrelay_time_to_first_token_seconds`
and `kvrelay_e2e_request_latency_seconds`). The verdict fails the canary when its 5xx share exceeds the
main release's by more than `--max-error-delta`, or its p99 (TTFT or end-to-end) exceeds
`--max-latency-ratio` times the main release's; with no request to the canary in the window there is
nothing to judge. Exit code 0 passes, 2 fails, 3 has no canary traffic, 1 when Prometheus does not answer.

The queries are plain PromQL (`queries`), so a dashboard or an alert can use the same ones.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass
from typing import Any

EXIT_PASS, EXIT_UNREACHABLE, EXIT_FAIL, EXIT_NO_TRAFFIC = 0, 1, 2, 3
LATENCIES = {"ttft": "kvrelay_time_to_first_token_seconds", "e2e": "kvrelay_e2e_request_latency_seconds"}
QUANTILES = {"p50": 0.5, "p99": 0.99}


@dataclass(frozen=True)
class ReleaseFigures:
    release: str
    requests_per_s: float | None
    error_share: float | None  # 5xx over all, None without requests
    latency_s: dict[str, float | None]  # "ttft_p50", "ttft_p99", "e2e_p50", "e2e_p99"


def selector(release: str, namespace: str | None, extra: str = "") -> str:
    labels = [f'service="{release}-codec"']
    if namespace:
        labels.append(f'namespace="{namespace}"')
    if extra:
        labels.append(extra)
    return "{" + ",".join(labels) + "}"


def queries(release: str, window: str, namespace: str | None = None) -> dict[str, str]:
    """The PromQL of each figure of one release."""
    every = selector(release, namespace)
    failed = selector(release, namespace, 'status=~"5.."')
    out = {
        "requests_per_s": f"sum(rate(kvrelay_requests_total{every}[{window}]))",
        "error_share": (
            f"(sum(rate(kvrelay_requests_total{failed}[{window}])) or vector(0))"
            f" / sum(rate(kvrelay_requests_total{every}[{window}]))"
        ),
    }
    for name, metric in LATENCIES.items():
        for label, q in QUANTILES.items():
            out[f"{name}_{label}"] = (
                f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{every}[{window}])))"
            )
    return out


def query(prometheus: str, promql: str, timeout_s: float = 10.0) -> float | None:
    """One instant query's scalar: the first sample's value, None when empty or NaN."""
    url = f"{prometheus.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        document = json.load(response)
    if document.get("status") != "success":
        raise ValueError(f"Prometheus refused the query: {document.get('error', document)}")
    result = document["data"]["result"]
    if not result:
        return None
    value = float(result[0]["value"][1])
    return None if math.isnan(value) or math.isinf(value) else value


def figures(prometheus: str, release: str, window: str, namespace: str | None) -> ReleaseFigures:
    values = {name: query(prometheus, promql) for name, promql in queries(release, window, namespace).items()}
    latency = {name: values[name] for name in values if name.startswith(tuple(LATENCIES))}
    rps = values["requests_per_s"]
    error_share = values["error_share"] if rps else None
    return ReleaseFigures(release, rps, error_share, latency)


def verdict(
    main: ReleaseFigures, canary: ReleaseFigures, max_error_delta: float, max_latency_ratio: float
) -> tuple[str, list[str]]:
    """("pass" | "fail" | "no_traffic", the reasons it failed)."""
    if not canary.requests_per_s:
        return "no_traffic", []
    reasons = []
    if (canary.error_share or 0.0) > (main.error_share or 0.0) + max_error_delta:
        reasons.append(
            f"5xx share {canary.error_share:.4f} against {main.error_share or 0.0:.4f} "
            f"(allowed +{max_error_delta})"
        )
    for name in ("ttft_p99", "e2e_p99"):
        mine, theirs = canary.latency_s.get(name), main.latency_s.get(name)
        if mine is not None and theirs and mine > max_latency_ratio * theirs:
            reasons.append(f"{name} {mine:.3f}s against {theirs:.3f}s (allowed x{max_latency_ratio})")
    return ("fail" if reasons else "pass"), reasons


def _cell(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value * 100:.2f}%" if unit == "%" else f"{value:.3f}{unit}"


def table(main: ReleaseFigures, canary: ReleaseFigures) -> str:
    rows = [("", main.release, canary.release)]
    rows.append(("requests/s", _cell(main.requests_per_s, ""), _cell(canary.requests_per_s, "")))
    rows.append(("5xx share", _cell(main.error_share, "%"), _cell(canary.error_share, "%")))
    for name in main.latency_s:
        rows.append((name, _cell(main.latency_s[name], "s"), _cell(canary.latency_s.get(name), "s")))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
    return "\n".join(line.rstrip() for line in lines)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "canary", help="a grey release's main and canary releases side by side, from Prometheus"
    )
    p.add_argument("--prometheus", required=True, help="Prometheus' base URL")
    p.add_argument("--main", required=True, help="the main release's name")
    p.add_argument("--canary", required=True, help="the canary release's name")
    p.add_argument("--namespace", default=None, help="only series of this namespace")
    p.add_argument("--window", default="5m", help="the range of each rate (PromQL duration)")
    p.add_argument("--max-error-delta", type=float, default=0.01, help="allowed extra 5xx share")
    p.add_argument("--max-latency-ratio", type=float, default=1.5, help="allowed p99 ratio")
    p.add_argument("--json", action="store_true", help="print the figures and verdict as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        main = figures(args.prometheus, args.main, args.window, args.namespace)
        canary = figures(args.prometheus, args.canary, args.window, args.namespace)
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        print(f"kvrelay canary: Prometheus at {args.prometheus} did not answer: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    outcome, reasons = verdict(main, canary, args.max_error_delta, args.max_latency_ratio)
    if args.json:
        document: dict[str, Any] = {"main": asdict(main), "canary": asdict(canary)}
        document.update(verdict=outcome, reasons=reasons, window=args.window)
        print(json.dumps(document, indent=1))
    else:
        print(table(main, canary))
        print(f"verdict: {outcome}" + "".join(f"\n  {reason}" for reason in reasons))
    return {"pass": EXIT_PASS, "fail": EXIT_FAIL}.get(outcome, EXIT_NO_TRAFFIC)
