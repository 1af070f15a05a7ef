"""`kvrelay codec`: the HTTP front door (OpenAI protocols) and, with --grpc-port, the public gRPC API."""

from __future__ import annotations

import argparse

DEFAULT_GRACE_S = 30.0  # kept equal to services.codec.server's; importing it here would pull in uvicorn


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("codec", help="run the codec (HTTP and public gRPC front door) in front of a router")
    p.add_argument("--config", default=None, help="kvrelay YAML config")
    p.add_argument("--model", default=None, help="model directory for the tokenizer (default: model.path)")
    p.add_argument("--router", required=True, help="router gRPC address, HOST:PORT")
    p.add_argument("--host", default=None, help="listen address (default: server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="listen port (default: server.port, 8000)")
    p.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="serve the public gRPC API (kvrelay.v1.Inference, health, reflection; docs/grpc.md) on this "
        "port at --host; 0 or absent: off",
    )
    p.add_argument(
        "--drain",
        action="store_true",
        help="also run queued background responses at spare capacity (a drainer; needs queue.url, "
        "docs/async.md)",
    )
    p.add_argument("--grace-seconds", type=float, default=DEFAULT_GRACE_S, help="graceful shutdown timeout")
    p.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="default: logging.codec, else logging.level (info)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from services.codec.server import main

    return main(args)
