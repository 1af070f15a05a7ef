"""`kvrelay bench`: measured side by side with a baseline, in one run. JSON plus PNG plots."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (engine)")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    from services.cli import bench_engine, bench_routing, bench_stack, bench_transfer

    bench_engine.register(bench_sub)
    bench_stack.register(bench_sub)
    bench_transfer.register(bench_sub)
    bench_routing.register(bench_sub)
    from services.cli import bench_serve

    bench_serve.register(bench_sub)
