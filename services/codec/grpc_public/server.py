"""The public gRPC server on `kvrelay codec --grpc-port`: kvrelay.v1.Inference, health and reflection.

This is the user-facing port, so it carries no internal token: callers present an API key instead
(`authorization: Bearer <key>` or `x-api-key` metadata, services/codec/admission/auth.py), checked
once per call by `ApiKeyInterceptor` against the same keys as HTTP. A missing or wrong key is
UNAUTHENTICATED (and one audit line); health and reflection stay open. The call's tenant is put in
`tenancy.CALL_TENANT` for the servicer (`auth.rpc_tenant()`), which moves it onto the call's stats.
Besides the Inference API it serves:
- grpc.health.v1.Health: "" and "kvrelay.v1.Inference" are SERVING while the codec is ready (the same
  check as HTTP /ready: the backend answers and its tokenizer fingerprint equals ours), polled every
  READINESS_POLL_S, and NOT_SERVING before the first check and once shutdown begins;
- server reflection (grpc.reflection.v1alpha) naming those three services, so generic clients
  (grpcurl, reflection-based tools) need no .proto files.

`serving(state)` is the HTTP app's companion lifespan (`create_app(serve_alongside=...)`): it starts the
server on the running event loop and, on exit, marks health NOT_SERVING, refuses new RPCs and gives
running ones up to `grace_s` to finish, before the app closes the backend. `begin_stop()` starts that
drain early, so the codec drains gRPC while uvicorn drains HTTP.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.codec.admission.auth import AUTHORIZATION, X_API_KEY, Authenticator
from services.codec.admission.tenancy import CALL_TENANT
from services.codec.backend.readiness import Readiness
from services.codec.errors import AuthenticationError
from services.codec.grpc_public.service import SERVICE_NAME, InferenceServicer
from services.codec.metrics import CodecMetrics, RequestStats
from services.codec.middleware import log_access, new_request_ids
from services.codec.state import CodecState
from services.common.grpc_auth import OPEN_METHOD_PREFIXES, REQUEST_ID_KEY
from services.common.tenants import Tenant
from services.proto_gen.kvrelay.v1 import public_pb2_grpc

logger = logging.getLogger(__name__)

READINESS_POLL_S = 1.0
HEALTH_SERVICE_NAMES = ("", SERVICE_NAME)
REFLECTED_SERVICE_NAMES = (
    SERVICE_NAME,
    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
    reflection.SERVICE_NAME,
)


class PublicGrpcServer:
    """One public gRPC server. `port` is the bound port once started (useful when asked for port 0)."""

    def __init__(
        self,
        host: str,
        port: int,
        grace_s: float,
        authenticator: Authenticator | None = None,
        credentials: grpc.ServerCredentials | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self._credentials = credentials  # TLS (entry_tls.ReloadingCertificate); None: plaintext
        self._grace_s = grace_s
        self._authenticator = authenticator  # None: built from the state's config at start
        self._server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self._poller: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @asynccontextmanager
    async def serving(self, state: CodecState) -> AsyncIterator[PublicGrpcServer]:
        await self.start(state)
        try:
            yield self
        finally:
            await self.stop()

    async def start(self, state: CodecState) -> None:
        """Binds and starts serving; a port that cannot be bound raises here."""
        max_message_bytes = state.config.limits.max_body_bytes
        authenticator = self._authenticator or Authenticator.from_config(state.config.auth)
        server = grpc.aio.server(
            interceptors=[ApiKeyInterceptor(authenticator, state.metrics)],
            options=[("grpc.max_receive_message_length", max_message_bytes)],
        )
        health_servicer = health.aio.HealthServicer()
        public_pb2_grpc.add_InferenceServicer_to_server(InferenceServicer(state), server)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(REFLECTED_SERVICE_NAMES, server)
        if self._credentials is not None:
            self.port = server.add_secure_port(self.address, self._credentials)
        else:
            self.port = server.add_insecure_port(self.address)
        for name in HEALTH_SERVICE_NAMES:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server, self._health = server, health_servicer
        self._poller = asyncio.create_task(self._follow_readiness(state.readiness, health_servicer))
        logger.info("public gRPC API serving", extra={"address": self.address})

    def begin_stop(self) -> None:
        """Starts the graceful stop (idempotent); `stop` waits for it."""
        if self._stopping is None and self._server is not None:
            self._stopping = asyncio.get_running_loop().create_task(self._stop())

    async def stop(self) -> None:
        """Health NOT_SERVING, no new RPCs, running ones get up to `grace_s`. Safe to call twice."""
        self.begin_stop()
        if self._stopping is not None:
            await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(self._grace_s)
        logger.info("public gRPC API stopped", extra={"address": self.address})

    async def _follow_readiness(
        self, readiness: Readiness, health_servicer: health.aio.HealthServicer
    ) -> None:
        is_serving: bool | None = None
        while True:
            try:
                is_ready = (await readiness.check()).is_ready
            except Exception as exc:  # a probe must not die: count it as not ready
                logger.warning("readiness check failed: %s", type(exc).__name__, exc_info=exc)
                is_ready = False
            if is_ready != is_serving:
                is_serving = is_ready
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if is_ready
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for name in HEALTH_SERVICE_NAMES:
                    await health_servicer.set(name, status)
            await asyncio.sleep(READINESS_POLL_S)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """API keys on the public gRPC port: every method but health and reflection needs a valid key."""

    def __init__(self, authenticator: Authenticator, metrics: CodecMetrics) -> None:
        self._authenticator = authenticator
        self._metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        metadata = details.invocation_metadata or ()
        try:
            tenant = self._authenticator.authenticate(
                _metadata_value(metadata, AUTHORIZATION), _metadata_value(metadata, X_API_KEY)
            )
        except AuthenticationError as exc:
            self._metrics.observe_auth_failure(exc.reason)
            request_id, _ = new_request_ids(_metadata_value(metadata, REQUEST_ID_KEY))
            log_access(RequestStats(request_id=request_id), 401, method="gRPC", route=details.method)
            message = str(exc)
            return _rebuild(handler, lambda behavior: _refuse(message, behavior))
        return _rebuild(handler, lambda behavior: _as_tenant(tenant, behavior))


Behavior = Callable[..., Any]


def _as_tenant(tenant: Tenant, behavior: Behavior) -> Behavior:
    """`behavior`, run with the call's tenant in CALL_TENANT (each call has its own task and context)."""
    if inspect.isasyncgenfunction(behavior):

        async def generate(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            CALL_TENANT.set(tenant)
            async for item in behavior(request, context):
                yield item

        return generate

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        CALL_TENANT.set(tenant)
        return await behavior(request, context)

    return call


def _refuse(message: str, behavior: Behavior) -> Behavior:
    if inspect.isasyncgenfunction(behavior):

        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - makes this an async generator

        return refuse_stream

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return refuse


def _rebuild(handler: grpc.RpcMethodHandler, wrap: Callable[[Behavior], Behavior]) -> grpc.RpcMethodHandler:
    """The same handler (kind and serializers) with its behavior wrapped."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **kw)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **kw)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **kw)
    return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **kw)


def _metadata_value(metadata: Any, key: str) -> str | None:
    for item_key, value in metadata:
        if item_key == key:
            return value if isinstance(value, str) else None
    return None
