"""`kvrelay bench compare`: side by side `kvrelay bench serve` results of several servers, and the
first one's ratio to each of the others.

    kvrelay bench compare OUT/kvrelay.json OUT/llama-cpp.json ... --out OUT

The first file is the reference (ours). Each file is one `bench serve --json` result, named by its
`label` (else its file stem); the first run of each is compared. Writes OUT/compare.md (a Markdown
table: each server's numbers, then reference/peer ratios), OUT/compare.json and OUT/compare.png (the
latency CDFs of every server on one set of axes). `kvrelay bench peers` ends with this.

Ratios are reference ÷ peer for every number: for latencies (TTFT, TPOT, ITL, e2e) below 1 means the
reference is faster; for rates (requests/s, output tokens/s, goodput) above 1 means it serves more.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.bench.serve.report import plot_cdfs

ROWS: tuple[tuple[str, str, str | None], ...] = (
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p90 ms", "ttft_ms", "p90"),
    ("TTFT p99 ms", "ttft_ms", "p99"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
    ("TPOT p99 ms", "tpot_ms", "p99"),
    ("ITL p50 ms", "itl_ms", "p50"),
    ("ITL p99 ms", "itl_ms", "p99"),
    ("e2e p50 ms", "e2e_ms", "p50"),
    ("e2e p99 ms", "e2e_ms", "p99"),
    ("requests/s", "requests_per_s", None),
    ("output tok/s", "output_tok_s", None),
    ("goodput req/s", "goodput_rps", None),
    ("completed", "completed", None),
    ("completion tokens", "completion_tokens", None),
    ("prefix hit rate", "prefix_hit_rate", None),
)


def _value(summary: dict[str, Any], key: str, sub: str | None) -> float | None:
    value = summary.get(key)
    if sub is not None:
        value = (value or {}).get(sub)
    return None if value is None else float(value)


def _label(path: Path, result: dict[str, Any]) -> str:
    return str(result.get("label") or path.stem)


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per row: each server's number and the reference's ratio to each peer."""
    names = list(results)
    reference, peers = names[0], names[1:]
    summaries = {name: result["runs"][0]["summary"] for name, result in results.items()}
    rows = []
    for title, key, sub in ROWS:
        values = {name: _value(summaries[name], key, sub) for name in names}
        ours = values[reference]
        ratios = {
            peer: round(ours / v, 3) if ours is not None and v else None
            for peer, v in ((p, values[p]) for p in peers)
        }
        rows.append({"metric": title, "values": values, "ratios": ratios})
    return {"reference": reference, "peers": peers, "rows": rows}


def _cell(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return str(int(value)) if value.is_integer() and abs(value) >= 1 else f"{value:.{digits}f}"


def markdown(table: dict[str, Any]) -> str:
    reference, peers = table["reference"], table["peers"]
    header = ["metric", reference, *peers, *(f"{reference} ÷ {p}" for p in peers)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in table["rows"]:
        values = [_cell(row["values"][n], 2) for n in [reference, *peers]]
        ratios = [_cell(row["ratios"][p], 2) for p in peers]
        lines.append("| " + " | ".join([row["metric"], *values, *ratios]) + " |")
    return "\n".join(lines)


def _overlay(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One result whose runs are each server's first run, labelled by server, for one CDF plot."""
    first = next(iter(results.values()))
    runs = [dict(result["runs"][0], label=name) for name, result in results.items()]
    return dict(first, runs=runs, model="each server's own copy")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compare",
        help="bench serve results of several servers side by side, with ratios",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("results", nargs="+", type=Path, help="bench serve --json files; the first is ours")
    p.add_argument("--out", type=Path, required=True)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    results: dict[str, dict[str, Any]] = {}
    for path in args.results:
        result = json.loads(path.read_text())
        results[_label(path, result)] = result
    table = compare(results)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare.json").write_text(json.dumps(table, indent=1))
    text = markdown(table)
    (args.out / "compare.md").write_text(text + "\n")
    plot_cdfs(_overlay(results), args.out / "compare.png")
    print(text)
    return 0
