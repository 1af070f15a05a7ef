"""`kvrelay bench`: the benchmarks, measured side by side with a baseline in one run (JSON plus PNG plots).

They live in services/bench/ and need the `bench` extra: this stub registers the command without importing
them, and hands everything after `kvrelay bench` to `services.bench.cli` only when the command runs (so
`kvrelay bench --help` lists the benchmarks). Without the extra it prints one line saying how to install
it and exits 2. The images carry neither the extra nor services/bench itself (their .dockerignore files
leave it out); where the package is missing, the line says so, also exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence

# The import names of the `bench` extra's packages (pyproject.toml; a unit test keeps the two in step).
BENCH_EXTRA_MODULES = ("aiohttp", "httpx", "matplotlib", "psutil")
MISSING_EXTRA = "kvrelay bench needs the bench extra: pip install 'kvrelay[bench]'"
MISSING_EXTRA_EXIT_CODE = 2
BENCH_PACKAGE = "services.bench"
MISSING_PACKAGE = (
    "kvrelay bench is not part of this installation (the images leave services/bench out): "
    "run it from a source checkout, with pip install -e '.[bench]'"
)


def register(sub: argparse._SubParsersAction) -> None:
    # No option of its own ('+' prefixes: none): every argument, --help included, goes to services.bench.
    p = sub.add_parser(
        "bench",
        help="benchmarks: engine, stack, serve, compare, peers, routing, transfer, admission (bench extra)",
        add_help=False,
        prefix_chars="+",
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(handler=run)


def missing_modules(names: Sequence[str] = BENCH_EXTRA_MODULES) -> list[str]:
    """The modules of `names` that cannot be imported here."""
    missing = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(name)
    return missing


def run(args: argparse.Namespace) -> int:
    if missing_modules([BENCH_PACKAGE]):  # finds it without importing it
        print(MISSING_PACKAGE, file=sys.stderr)
        return MISSING_EXTRA_EXIT_CODE
    missing = missing_modules()
    if missing:
        print(f"{MISSING_EXTRA} (missing: {', '.join(missing)})", file=sys.stderr)
        return MISSING_EXTRA_EXIT_CODE
    from services.bench.cli import main

    return main(args.bench_args)
