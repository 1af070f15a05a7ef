"""Per-file test durations from a pytest JUnit XML report, for tests/durations.json and docs/testing.md.

    .venv/bin/python -m pytest -q --junitxml=report.xml ...
    .venv/bin/python scripts/suite_durations.py report.xml --write tests/durations.json --slowest 30

`make test` hands test files to its workers longest first (tests/conftest.py reads tests/durations.json), so a
long file never starts last and holds one worker while the other idles. The numbers only order the work:
a stale or missing entry costs some idle time at the end, never a test.
"""

from __future__ import annotations

import argparse
import json
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_file(classname: str) -> str:
    """tests.unit.test_x or tests.unit.test_x.TestClass -> tests/unit/test_x.py."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        candidate = "/".join(parts[:end]) + ".py"
        if (REPO_ROOT / candidate).exists():
            return candidate
    return "/".join(parts) + ".py"


def read_cases(report: Path) -> list[tuple[str, str, float]]:
    """(file, test name, seconds) for every test case in the report."""
    root = ET.parse(report).getroot()
    return [
        (test_file(case.get("classname", "")), case.get("name", ""), float(case.get("time", "0")))
        for case in root.iter("testcase")
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("report", type=Path, help="pytest --junitxml output")
    p.add_argument("--write", type=Path, help="write {file: seconds} here (tests/durations.json)")
    p.add_argument("--slowest", type=int, default=0, help="print the N slowest tests and files")
    args = p.parse_args()
    cases = read_cases(args.report)
    per_file: dict[str, float] = defaultdict(float)
    for file, _, seconds in cases:
        per_file[file] += seconds
    print(f"{len(cases)} tests, {sum(per_file.values()):.0f} s in {len(per_file)} files")
    if args.write:
        ordered = dict(sorted(((f, round(s, 1)) for f, s in per_file.items()), key=lambda kv: -kv[1]))
        args.write.write_text(json.dumps(ordered, indent=1) + "\n")
    if args.slowest:
        for file, name, seconds in sorted(cases, key=lambda c: -c[2])[: args.slowest]:
            print(f"{seconds:8.1f} s  {file}::{name}")
        print()
        for file, seconds in sorted(per_file.items(), key=lambda kv: -kv[1])[: args.slowest]:
            print(f"{seconds:8.1f} s  {file}")


if __name__ == "__main__":
    main()
