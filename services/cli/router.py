"""`kvrelay router`: the router over a static list of workers."""

from __future__ import annotations

import argparse
import asyncio

from services.common.config import load_config
from services.common.logs import configure_logging


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the router (gRPC)")
    p.add_argument("--config", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", required=True, help="comma-separated HOST:PORT list")
    p.add_argument("--grace-seconds", type=float, default=30.0)
    p.add_argument(
        "--model-fingerprint",
        default=None,
        help="the pool's model; workers reporting another are never used (default: the first to answer)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from services.router.server import RouterOptions, serve

    configure_logging("router")
    cfg = load_config(args.config)
    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    options = RouterOptions(
        args.host, args.port, workers, args.grace_seconds, args.model_fingerprint, cfg.disaggregation
    )
    asyncio.run(serve(options))
    return 0
