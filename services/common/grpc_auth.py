"""Internal trust for gRPC: a shared token in `authorization: Bearer <token>`, checked in constant time by a
server interceptor. Health and reflection stay open so probes and generic clients work. The token comes
from env KVRELAY_INTERNAL_TOKEN or the file named by KVRELAY_INTERNAL_TOKEN_FILE (re-read when it
changes, so it can rotate without a restart)."""

from __future__ import annotations

import hmac
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from services.common.errors import ConfigError

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
REQUEST_ID_KEY = "x-request-id"


class TokenSource:
    """The current internal token: a fixed value, or a file's content re-read when its mtime changes."""

    def __init__(self, value: str | None = None, path: Path | None = None) -> None:
        self._value = value
        self._path = path
        self._mtime = 0.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TokenSource:
        env = os.environ if env is None else env
        if env.get("KVRELAY_INTERNAL_TOKEN"):
            return cls(value=env["KVRELAY_INTERNAL_TOKEN"])
        if env.get("KVRELAY_INTERNAL_TOKEN_FILE"):
            return cls(path=Path(env["KVRELAY_INTERNAL_TOKEN_FILE"]))
        raise ConfigError(
            "no internal token: set KVRELAY_INTERNAL_TOKEN or KVRELAY_INTERNAL_TOKEN_FILE "
            "(`kvrelay up` generates one for its children)"
        )

    def current(self) -> str:
        if self._path is None:
            return self._value or ""
        try:
            mtime = self._path.stat().st_mtime
            if mtime != self._mtime:
                self._value = self._path.read_text().strip()
                self._mtime = mtime
        except OSError as exc:
            raise ConfigError(f"cannot read the internal token file {self._path}: {exc}") from exc
        return self._value or ""

    def metadata(self, request_id: str = "") -> tuple[tuple[str, str], ...]:
        md: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {self.current()}"),)
        return (*md, (REQUEST_ID_KEY, request_id)) if request_id else md


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: TokenSource) -> None:
        self._tokens = tokens

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if details.method.startswith(OPEN_METHOD_PREFIXES) or handler is None:
            return handler
        metadata = dict(details.invocation_metadata or ())
        given = str(metadata.get("authorization", ""))
        if hmac.compare_digest(given.encode(), f"Bearer {self._tokens.current()}".encode()):
            return handler
        return _deny(handler)


def _deny(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    message = "missing or wrong internal token"

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def request_id_of(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return str(value)
    return ""
