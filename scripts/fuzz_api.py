"""Fuzz a running codec's API from its own OpenAPI document (GET /openapi.json, services/codec/protocols/
openapi.py): schemathesis generates request bodies for every operation, valid ones and ones that break the
schema (its positive and negative modes), sends them, and this checks each answer: no 5xx, no request
that outlives --timeout or drops its connection (a hang, a crash), no error event inside a 200 stream,
and an error body in the protocol's shape (`{"error": ...}`, or Anthropic's `{"type": "error", ...}` under
/v1/messages).

    python scripts/fuzz_api.py --url http://127.0.0.1:8000 --examples 200 --json fuzz.json
    python scripts/fuzz_api.py --url https://kvrelay.example.com --api-key "$KEY" --seed 7

Cap `limits.max_output_tokens` on the codec under test (every valid request generates). The run is
reproducible for one --seed and one served document. Exit 0 when every answer passed, 1 otherwise, with
the failing cases (operation, body, status, answer) in the report: each one belongs in a regression test.
tests/e2e/test_fuzz_api.py runs this with --examples 50 against the end-to-end stack.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the codec's base URL")
    parser.add_argument("--api-key", default="open", help="sent as a bearer token")
    parser.add_argument("--examples", type=int, default=200, help="cases per operation")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds a request may take: past it, a hang"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    args = parser.parse_args(argv)
    report = fuzz(args.url.rstrip("/"), args.api_key, args.examples, args.seed, args.timeout)
    text = json.dumps(report, indent=2)
    if args.json:
        args.json.write_text(text)
    print(json.dumps({k: v for k, v in report.items() if k != "failures"}, indent=2))
    for failure in report["failures"][:10]:
        print("FAILED", json.dumps(failure)[:2000], file=sys.stderr)
    return 0 if not report["failures"] else 1


def fuzz(url: str, api_key: str, examples: int, run_seed: int, timeout_s: float) -> dict[str, Any]:
    headers = {"authorization": f"Bearer {api_key}"}
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json", headers=headers)
    operations: dict[str, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    started = time.monotonic()
    for result in schema.get_all_operations():
        operation = result.ok()
        name = f"{operation.method.upper()} {operation.path}"
        statuses = _run_operation(operation, name, url, headers, examples, run_seed, timeout_s, failures)
        operations[name] = {"cases": sum(statuses.values()), "statuses": dict(sorted(statuses.items()))}
    return {
        "url": url, "seed": run_seed, "examples_per_operation": examples,
        "seconds": round(time.monotonic() - started, 1), "operations": operations, "failures": failures,
    }  # fmt: skip


def _run_operation(
    operation: Any, name: str, url: str, headers: dict[str, str], examples: int, run_seed: int,
    timeout_s: float, failures: list[dict[str, Any]],
) -> Counter[int]:  # fmt: skip
    """Send `examples` generated cases of one operation; their statuses, failures appended."""
    statuses: Counter[int] = Counter()

    @seed(run_seed)
    @settings(
        max_examples=examples, deadline=None, database=None,
        suppress_health_check=list(HealthCheck), print_blob=True,
    )  # fmt: skip
    @given(case=st.one_of(*(operation.as_strategy(generation_mode=mode) for mode in GenerationMode)))
    def run(case: Any) -> None:
        try:
            response = case.call(base_url=url, headers=headers, timeout=timeout_s)
        except (requests.RequestException, TimeoutError) as exc:  # no answer in time, or a dropped one
            failures.append({"operation": name, "body": case.body, "problem": f"{type(exc).__name__}: {exc}"})
            return
        statuses[response.status_code] += 1
        problem = _problem(operation.path, response)
        if problem is not None:
            failures.append(
                {
                    "operation": name, "body": case.body, "status": response.status_code,
                    "problem": problem, "answer": response.text[:2000],
                }
            )  # fmt: skip

    run()
    return statuses


def _problem(path: str, response: Any) -> str | None:
    """What is wrong with an answer; None when it passes. A 503 fails too: on a healthy stack under one
    request at a time nothing is unavailable, so one means an input broke something."""
    if getattr(response, "stream_cut_short", False):
        return "a streamed answer still open at --timeout (a hang)"
    if response.status_code >= 500:
        return "a server error"
    if response.status_code < 400:
        return _stream_error(response.text)
    try:
        body = response.json()
    except ValueError:
        return "an error body that is not JSON"
    anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
    shaped = isinstance(body, dict) and (body.get("type") == "error" if anthropic else "error" in body)
    return None if shaped else "an error body not in the protocol's shape"


def _stream_error(text: str) -> str | None:
    """An error event inside a 200 stream: the stack failed mid-answer."""
    for line in text.splitlines():
        if line.startswith("event: error") or line.startswith('data: {"error"'):
            return "an error event inside a 200 stream"
    return None


if __name__ == "__main__":
    sys.exit(main())
