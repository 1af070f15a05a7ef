"""The identity suite (tests/identity_suite.py) with and without engine.deterministic, as a Markdown table:
for each weight format and condition, whether the tracked requests' answers are bitwise those of the
requests alone ("identical"), differ in logprobs only, or in tokens. docs/deterministic.md shows a run.

    PYTHONPATH=. .venv/bin/python scripts/identity_report.py models/smollm2-135m-instruct

Needs a Redis for the shared-tier condition (--redis-url, default the local one).
"""

from __future__ import annotations

import argparse
import logging
import uuid
from pathlib import Path

from tests.identity_suite import CONDITIONS, Suite, how_they_differ, tracked_requests

RUNS = (("gguf-hybrid", False), ("gguf-int8", False), ("safetensors", False),
        ("gguf-int8", True), ("gguf", True), ("safetensors", True))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    logging.disable(logging.INFO)
    print("| weights | mode | " + " | ".join(CONDITIONS[1:]) + " |")
    print("|---|---|" + "---|" * (len(CONDITIONS) - 1))
    for weights, chosen in RUNS:
        suite = Suite(args.model_dir, weights, chosen, args.redis_url, uuid.uuid4().bytes, tracked_requests())
        conditions = suite.conditions()
        reference = conditions.pop("alone")()
        cells = [how_they_differ(reference, run()) for run in conditions.values()]
        mode = "deterministic" if chosen else "default"
        print(f"| {weights} | {mode} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
