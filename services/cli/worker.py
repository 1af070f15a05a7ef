"""`kvrelay worker`: one engine behind the internal gRPC API."""

from __future__ import annotations

import argparse
import asyncio

from services.common.config import load_config
from services.common.logs import configure_logging


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker", help="run a worker (engine over gRPC)")
    p.add_argument("--config", default=None)
    p.add_argument("--model", default=None, help="model directory (default: model.path)")
    p.add_argument("--role", choices=["colocated", "prefill", "decode"], default="colocated")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: engine.num_threads)")
    p.add_argument("--name", default="worker-0")
    p.add_argument("--grace-seconds", type=float, default=30.0)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from services.worker.server import WorkerOptions, serve

    cfg = load_config(args.config)
    configure_logging(f"worker:{args.name}", cfg.logging.for_service("worker"))
    if args.model:
        cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": args.model})})
    if args.threads:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"num_threads": args.threads})})
    options = WorkerOptions(args.host, args.port, args.role, args.name, args.grace_seconds, args.metrics_port)
    asyncio.run(serve(cfg, options))
    return 0
