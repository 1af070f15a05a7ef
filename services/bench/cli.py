"""The flags of `kvrelay bench`: one subcommand per benchmark, each registered by its own module.

`services/cli/bench.py` hands this module the arguments after `kvrelay bench`, once it has checked that
the `bench` extra is installed; `main` parses them and runs the subcommand's handler.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from services.bench import agreement, async_lane, engine, grammar, kv_tiers, peers, stack, threshold
from services.bench.admission import command as admission
from services.bench.routing import command as routing
from services.bench.serve import command as serve
from services.bench.serve import compare
from services.bench.soak import command as soak
from services.bench.transfer import command as transfer

Handler = Callable[[argparse.Namespace], int]
SUBCOMMANDS = (
    engine,
    agreement,
    stack,
    transfer,
    routing,
    serve,
    compare,
    admission,
    peers,
    grammar,
    threshold,
    kv_tiers,
    async_lane,
    soak,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvrelay bench",
        description="kvrelay benchmarks: measured side by side with a baseline, in one run",
    )
    sub = parser.add_subparsers(dest="bench_command", required=True)
    for module in SUBCOMMANDS:
        module.register(sub)
    return parser


def main(argv: Sequence[str]) -> int:
    """Parse `argv` (what follows `kvrelay bench`) and run that benchmark."""
    args = build_parser().parse_args(list(argv))
    handler: Handler = args.handler
    return handler(args)
