"""The codec's HTTP app: assembles state, middleware, error handlers and the routers. No logic here."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext

from fastapi import FastAPI

from services.codec import routes_health, routes_misc
from services.codec.admission.auth import Authenticator, AuthMiddleware
from services.codec.backend.protocol import Backend
from services.codec.errors import install_error_handlers
from services.codec.grpc_public.service import PROTOCOLS as GRPC_PROTOCOLS
from services.codec.lane.background import background_from_config
from services.codec.lane.batches import batches_from_config
from services.codec.lane.drainer import Drainer
from services.codec.lane.metrics import BatchMetrics, refreshing
from services.codec.middleware import BodyLimitMiddleware, RequestContextMiddleware, leak_bytes_from_env
from services.codec.protocols import (
    anthropic_batches,
    anthropic_messages,
    openai_batches,
    openai_chat,
    openai_completions,
    openai_files,
    openai_responses,
    openai_responses_compact,
    openapi,
)
from services.codec.protocols.openai_responses import install_responses
from services.codec.protocols.openai_responses_ws import ResponsesWebSocketMiddleware, WebSocketHub
from services.codec.routes_health import kvrelay_version
from services.codec.state import CodecIdentity, CodecState
from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig
from services.common.errors import ConfigError

UPLOAD_OVERHEAD_BYTES = 64 * 1024  # a multipart upload's framing and fields beside the file
# Every generation route's protocol (compaction counts as "responses"), whose success and server-error
# series start at zero (metrics.CodecMetrics.prime).
PRIMED_PROTOCOLS = (
    *(module.PROTOCOL for module in (openai_chat, openai_completions, anthropic_messages, openai_responses)),
    *GRPC_PROTOCOLS.values(),
)


def create_app(
    backend: Backend,
    tokenizer: Tokenizer,
    config: KvrelayConfig,
    identity: CodecIdentity,
    *,
    serve_alongside: Callable[[CodecState], AbstractAsyncContextManager[object]] | None = None,
    authenticator: Authenticator | None = None,
    drain: bool = False,
    grace_s: float = 30.0,
) -> FastAPI:
    """One codec app over `backend`. The app owns the backend: it is closed when the app shuts down.

    `serve_alongside(state)` (the public gRPC server) is entered at startup and exited at shutdown,
    before the backend closes, so what it serves can finish. `authenticator` (default: from
    `config.auth`, which loads the keys file) is shared with the public gRPC server when there is one.
    `drain`: also run queued background responses (a drainer, services/codec/lane/drainer.py; it needs
    `queue.url`), giving the running ones `grace_s` to finish at shutdown."""
    state = CodecState.build(backend, tokenizer, config, identity)
    if authenticator is None:
        authenticator = Authenticator.from_config(config.auth)
    background = background_from_config(config.queue, identity, state.metrics.registry)
    if drain and background is None:
        raise ConfigError("a drainer needs the async lane's queue: set queue.url (docs/async.md)")
    batches = batches_from_config(
        config.batches, background.queue if background else None, BatchMetrics(state.metrics.registry)
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        drainer = (
            Drainer(app, background, authenticator, config.queue, backend.statuses, batches)
            if drain and background
            else None
        )
        draining = asyncio.create_task(drainer.run()) if drainer is not None else None
        app.state.drainer = drainer
        upkeep = []
        if batches is not None:
            await batches.store.open()
            upkeep.append(
                asyncio.create_task(batches.refresh_forever(config.queue.metrics_refresh_ms / 1000))
            )
            if drainer is not None:
                upkeep.append(asyncio.create_task(batches.sweep_forever()))
        try:
            alongside: AbstractAsyncContextManager[object] = (
                serve_alongside(state) if serve_alongside else nullcontext()
            )
            gauges: AbstractAsyncContextManager[object] = (
                refreshing(background.metrics, background.queue, config.queue.metrics_refresh_ms / 1000)
                if background
                else nullcontext()
            )
            async with alongside, gauges:
                yield
                if drainer is not None and draining is not None:
                    await drainer.stop(grace_s)
                    await draining
        finally:
            for task in upkeep:
                task.cancel()
            await asyncio.gather(*upkeep, return_exceptions=True)
            if batches is not None:
                await batches.store.aclose()
            if background is not None:
                await background.queue.aclose()
            await state.aclose()
            await backend.close()

    app = FastAPI(
        title="kvrelay codec",
        version=kvrelay_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.codec = state
    app.state.authenticator = authenticator
    install_error_handlers(app)
    for module in (openai_chat, openai_completions, routes_misc, routes_health):
        app.include_router(module.router)
    app.include_router(anthropic_messages.router)
    install_responses(app, config.responses, background=background)
    app.include_router(openai_responses_compact.router)
    app.state.batches = batches
    for module in (openai_files, openai_batches, anthropic_batches, openapi):
        app.include_router(module.router)
    upload_bytes = config.batches.max_file_bytes + UPLOAD_OVERHEAD_BYTES  # a file, or a batch's requests
    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=config.limits.max_body_bytes,
        larger={"/v1/files": upload_bytes, "/v1/messages/batches": upload_bytes} if batches else {},
    )
    state.metrics.prime(PRIMED_PROTOCOLS)
    app.add_middleware(AuthMiddleware, authenticator=authenticator, metrics=state.metrics)  # before the body
    app.add_middleware(
        RequestContextMiddleware,
        metrics=state.metrics,
        leak_bytes=leak_bytes_from_env(),
        release_headers=state.identity.release_headers,
    )
    # Outermost: each WebSocket turn comes back in through the whole HTTP stack above.
    hub = WebSocketHub(config.responses.websocket, config.server.max_connections, state.metrics)
    app.state.responses_ws = hub
    app.add_middleware(ResponsesWebSocketMiddleware, hub=hub, authenticator=authenticator)
    return app
