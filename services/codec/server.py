"""Running the codec: load and verify the tokenizer, connect to the router, serve HTTP with uvicorn and,
with a gRPC port, the public gRPC API (grpc_public/server.py) on the same event loop.

The tokenizer directory is checked against its manifest (tokenizer scope) first, so the fingerprints
the codec reports are those of the files it actually loaded. The API keys file (auth.keys_file) is
loaded before serving, once for HTTP and gRPC; without one the codec runs in open mode, which it logs and
which it refuses on a non-loopback address unless auth.allow_open is set. With server.metrics_port,
/metrics is served there (and not on the API port). Past server.max_connections open connections,
uvicorn answers 503 before any work. With server.tls, both API ports speak TLS only (HTTPS, gRPC over
TLS) with a certificate re-read on change (services/common/entry_tls.py); /metrics stays plain HTTP.
On SIGTERM/SIGINT, HTTP and gRPC drain together (each for up to the grace period), then the backend
closes. With `tracing.otlp_endpoint` set, spans go out as service `<prefix>-codec`, and the ones still
buffered are exported on the way out.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import math
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from prometheus_client import start_http_server

from services.codec.admission.auth import Authenticator
from services.codec.app import create_app
from services.codec.backend.protocol import Backend
from services.codec.grpc_public.server import PublicGrpcServer
from services.codec.protocols.openai_responses_ws import WebSocketHub
from services.codec.state import CodecIdentity
from services.codec.text.tokenizer import Tokenizer
from services.common import tracing
from services.common.config import KvrelayConfig, TlsConfig, WebSocketConfig, load_config
from services.common.entry_tls import ReloadingCertificate
from services.common.errors import ConfigError
from services.common.logs import configure_logging
from services.common.manifest import load_verified_manifest
from services.common.process_metrics import ConnectionsCollector

logger = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0


@dataclass(frozen=True)
class CodecOptions:
    model_dir: Path
    router_address: str
    host: str
    port: int
    grace_s: float = DEFAULT_GRACE_S
    grpc_port: int = 0  # the public gRPC API's port on `host`; 0 is off
    drain: bool = False  # also run queued background responses (services/codec/lane/drainer.py)


def load_tokenizer(model_dir: Path, config: KvrelayConfig) -> tuple[Tokenizer, CodecIdentity]:
    """The verified tokenizer and who we are. Raises ModelLoadError subclasses on a bad directory."""
    manifest = load_verified_manifest(model_dir, scope="tokenizer")
    tokenizer = Tokenizer.from_dir(model_dir)
    version = model_dir.name or model_dir.resolve().name  # the directory as named (model.version)
    name = config.model.served_name or model_dir.resolve().name
    identity = CodecIdentity(
        name, manifest.tokenizer_fingerprint, manifest.model_fingerprint, model_version=version
    )
    return tokenizer, identity


def connect_backend(router_address: str, tls: TlsConfig | None = None) -> Backend:
    """The gRPC backend to the router. Call inside the running event loop (gRPC aio binds to it)."""
    from services.codec.backend.grpc_client import GrpcBackend
    from services.common.grpc_auth import TokenSource

    return GrpcBackend(router_address, TokenSource.from_env(), tls)


class CodecServer(uvicorn.Server):
    """uvicorn whose shutdown also starts draining the public gRPC server, so both drain at once; the
    app's lifespan then waits for that drain before it closes the backend."""

    def __init__(
        self, config: uvicorn.Config, public_grpc: PublicGrpcServer | None, grace_s: float = DEFAULT_GRACE_S
    ) -> None:
        super().__init__(config)
        self.public_grpc = public_grpc
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.public_grpc is not None:
            self.public_grpc.begin_stop()
        # Responses WebSockets first: each finishes its response in flight, then gets an error event
        # and close 1001 (uvicorn's own shutdown would cut them with 1012).
        hub = _websocket_hub(self.config.app)
        if hub is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(hub.drain(), self.grace_s)
        await super().shutdown(sockets)


def _websocket_hub(app: object) -> WebSocketHub | None:
    hub = getattr(getattr(app, "state", None), "responses_ws", None)
    return hub if isinstance(hub, WebSocketHub) else None


async def serve(config: KvrelayConfig, options: CodecOptions) -> None:
    authenticator = Authenticator.from_config(config.auth)  # one key store for HTTP and gRPC
    check_open_mode(authenticator, options.host, allow_open=config.auth.allow_open)
    tokenizer, identity = load_tokenizer(options.model_dir, config)
    log_auth_mode(authenticator)
    certificate = ReloadingCertificate(config.server.tls) if config.server.tls.enabled else None
    public_grpc = (
        PublicGrpcServer(
            options.host,
            options.grpc_port,
            options.grace_s,
            authenticator,
            credentials=certificate.grpc_credentials() if certificate else None,
        )
        if options.grpc_port
        else None
    )
    app = create_app(
        connect_backend(options.router_address, config.internal_tls),
        tokenizer,
        config,
        identity,
        serve_alongside=public_grpc.serving if public_grpc else None,
        authenticator=authenticator,
        drain=options.drain,
        grace_s=options.grace_s,
    )
    server_config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        timeout_graceful_shutdown=math.ceil(options.grace_s),
        log_config=None,
        access_log=False,
        lifespan="on",
        limit_concurrency=config.server.max_connections,  # past it: a 503 at once, no work done
        **websocket_settings(config.responses.websocket),
        **tls_settings(certificate),
    )
    listeners = {"http": options.port, "grpc": options.grpc_port, "metrics": config.server.metrics_port}
    app.state.codec.metrics.registry.register(
        ConnectionsCollector({name: port for name, port in listeners.items() if port})
    )
    if config.server.metrics_port is not None:  # its own port: the API port answers /metrics with 404
        start_http_server(
            config.server.metrics_port, addr=options.host, registry=app.state.codec.metrics.registry
        )
    logger.info(
        "codec serving",
        extra={
            "address": f"{options.host}:{options.port}",
            "grpc_address": public_grpc.address if public_grpc else None,
            "router": options.router_address,
            "metrics_port": config.server.metrics_port,
            "drainer": options.drain,
            "tls": certificate.fingerprint if certificate else None,
            "model": identity.model_name,
            "tokenizer_fingerprint": identity.tokenizer_fingerprint,
        },
    )
    tracing.setup_tracing(config.tracing, "codec")
    watcher = asyncio.create_task(certificate.watch()) if certificate else None
    try:
        await CodecServer(server_config, public_grpc, options.grace_s).serve()
    finally:
        if watcher is not None:
            watcher.cancel()
        tracing.shutdown_tracing()  # export the spans still buffered


def tls_settings(certificate: ReloadingCertificate | None) -> dict[str, Any]:
    """uvicorn's TLS: the listening context from the reloading certificate (entry_tls.py), or none."""
    if certificate is None:
        return {}
    return {"ssl_context_factory": lambda _config, _default: certificate.server_context()}


def websocket_settings(config: WebSocketConfig) -> dict[str, Any]:
    """uvicorn's WebSocket settings for the Responses socket (openai_responses_ws.py)."""
    return {
        "ws": "websockets-sansio",
        "ws_max_size": config.max_frame_bytes,
        "ws_ping_interval": config.ping_interval_s,
        "ws_ping_timeout": config.ping_timeout_s,
        "ws_per_message_deflate": False,  # compressing frames costs CPU per token; events are small
    }


def check_open_mode(authenticator: Authenticator, host: str, *, allow_open: bool) -> None:
    """Open mode (no keys file) only on a loopback address, unless `auth.allow_open` says otherwise:
    a codec bound where others can reach it would serve anyone as tenant "default"."""
    if authenticator.store is not None or allow_open or is_loopback(host):
        return
    raise ConfigError(
        f"refusing to serve without API keys on {host}, which other hosts can reach: set auth.keys_file "
        "(`kvrelay keys add`), or auth.allow_open: true (KVRELAY_AUTH__ALLOW_OPEN=true) to serve anyone"
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name other than localhost may resolve anywhere
        return False


def log_auth_mode(authenticator: Authenticator) -> None:
    """Open mode is said out loud at start; key mode names the file and how many keys it holds."""
    if authenticator.store is None:
        logger.warning("open mode: no API keys, every request is tenant default")
        return
    logger.info(
        "API keys required",
        extra={"keys_file": str(authenticator.store.path), "num_keys": authenticator.store.num_keys},
    )


def main(args: argparse.Namespace) -> int:
    """`kvrelay codec`: flags override the config's model path and server address."""
    config = load_config(args.config)
    configure_logging("codec", args.log_level or config.logging.for_service("codec"))
    model_dir = Path(args.model or config.model.path)
    host = args.host or config.server.host
    port = args.port or config.server.port
    config = config.model_copy(
        update={
            "model": config.model.model_copy(update={"path": str(model_dir)}),
            "server": config.server.model_copy(update={"host": host, "port": port}),
        }
    )
    options = CodecOptions(
        model_dir, args.router, host, port, args.grace_seconds, args.grpc_port or 0, bool(args.drain)
    )
    asyncio.run(serve(config, options))
    return 0
