"""Running the codec: load and verify the tokenizer, connect to the router, serve HTTP with uvicorn.

The tokenizer directory is checked against its manifest (tokenizer scope) first, so the fingerprints
the codec reports are those of the files it actually loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from services.codec.app import create_app
from services.codec.backend import Backend
from services.codec.state import CodecIdentity
from services.codec.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, load_config
from services.common.logs import configure_logging
from services.common.manifest import load_verified_manifest

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0


@dataclass(frozen=True)
class CodecOptions:
    model_dir: Path
    router_address: str
    host: str
    port: int
    grace_s: float = DEFAULT_GRACE_S


def load_tokenizer(model_dir: Path, config: KvrelayConfig) -> tuple[Tokenizer, CodecIdentity]:
    """The verified tokenizer and who we are. Raises ModelLoadError subclasses on a bad directory."""
    manifest = load_verified_manifest(model_dir, scope="tokenizer")
    tokenizer = Tokenizer.from_dir(model_dir)
    name = config.model.served_name or model_dir.resolve().name
    return tokenizer, CodecIdentity(name, manifest.tokenizer_fingerprint, manifest.model_fingerprint)


def connect_backend(router_address: str) -> Backend:
    """The gRPC backend to the router. Call inside the running event loop (gRPC aio binds to it)."""
    from services.codec.grpc_backend import GrpcBackend
    from services.common.grpc_auth import TokenSource

    return GrpcBackend(router_address, TokenSource.from_env())


async def serve(config: KvrelayConfig, options: CodecOptions) -> None:
    tokenizer, identity = load_tokenizer(options.model_dir, config)
    app = create_app(connect_backend(options.router_address), tokenizer, config, identity)
    server_config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        timeout_graceful_shutdown=math.ceil(options.grace_s),
        log_config=None,
        access_log=False,
        lifespan="on",
    )
    logger.info(
        "codec serving",
        extra={
            "address": f"{options.host}:{options.port}",
            "router": options.router_address,
            "model": identity.model_name,
            "tokenizer_fingerprint": identity.tokenizer_fingerprint,
        },
    )
    await uvicorn.Server(server_config).serve()


def main(args: argparse.Namespace) -> int:
    """`kvrelay codec`: flags override the config's model path and server address."""
    configure_logging("codec", args.log_level)
    config = load_config(args.config)
    model_dir = Path(args.model or config.model.path)
    host = args.host or config.server.host
    port = args.port or config.server.port
    config = config.model_copy(
        update={
            "model": config.model.model_copy(update={"path": str(model_dir)}),
            "server": config.server.model_copy(update={"host": host, "port": port}),
        }
    )
    options = CodecOptions(model_dir, args.router, host, port, args.grace_seconds)
    asyncio.run(serve(config, options))
    return 0
