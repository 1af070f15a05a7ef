"""Internal trust for gRPC: a shared token in `authorization: Bearer <token>`, checked in constant time by a
server interceptor. Health and reflection stay open so probes and generic clients work. The token comes
from env KVRELAY_INTERNAL_TOKEN or the file named by KVRELAY_INTERNAL_TOKEN_FILE, re-read when it
changes, so it rotates without a restart and without an outage:

- the file holds one token per line: the first is the one this process sends, and every one is accepted;
- rotating is three writes of every pod's file (a mounted Secret), each once the last has reached every
  pod: `old` + `new` (all accept both), then `new` + `old` (all send the new one), then `new` alone.

A token shorter than MIN_TOKEN_CHARS, or none, is refused at start (ConfigError, exit 78). A file that
later reads empty or short (caught mid-write, or a mistake) is not taken: the tokens already in force
stay, and the change is logged once."""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import grpc

from services.common.errors import ConfigError

log = logging.getLogger(__name__)

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
REQUEST_ID_KEY = "x-request-id"
MIN_TOKEN_CHARS = 16


class TokenSource:
    """The internal tokens: the one this process sends (`current`) and every one it accepts (`accepts`).
    A fixed value, or a file's lines re-read when its mtime changes (see the module doc)."""

    def __init__(self, value: str | None = None, path: Path | None = None) -> None:
        self._tokens: tuple[str, ...] = (value,) if value else ()
        self._path = path
        self._mtime = 0.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TokenSource:
        """The process's tokens; ConfigError when there are none or one is shorter than MIN_TOKEN_CHARS."""
        env = os.environ if env is None else env
        if env.get("KVRELAY_INTERNAL_TOKEN"):
            source = cls(value=env["KVRELAY_INTERNAL_TOKEN"])
        elif env.get("KVRELAY_INTERNAL_TOKEN_FILE"):
            source = cls(path=Path(env["KVRELAY_INTERNAL_TOKEN_FILE"]))
        else:
            raise ConfigError(
                "no internal token: set KVRELAY_INTERNAL_TOKEN or KVRELAY_INTERNAL_TOKEN_FILE "
                "(`kvrelay up` generates one for its children)"
            )
        problem = _problem(source._refreshed())  # a file is read now: its tokens are the ones in force
        if problem is not None:
            raise ConfigError(f"the internal token {problem}")
        return source

    def current(self) -> str:
        """The token to send."""
        tokens = self._refreshed()
        return tokens[0] if tokens else ""

    def accepts(self, token: str) -> bool:
        """Whether `token` is one of the tokens in force (constant time in each comparison)."""
        given = token.encode()
        return any(hmac.compare_digest(given, t.encode()) for t in self._refreshed())

    def metadata(self, request_id: str = "") -> tuple[tuple[str, str], ...]:
        md: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {self.current()}"),)
        return (*md, (REQUEST_ID_KEY, request_id)) if request_id else md

    def _refreshed(self) -> tuple[str, ...]:
        if self._path is None:
            return self._tokens
        try:
            mtime = self._path.stat().st_mtime
        except OSError as exc:
            raise ConfigError(f"cannot read the internal token file {self._path}: {exc}") from exc
        if mtime != self._mtime:
            self._mtime = mtime
            tokens = self._read()
            problem = _problem(tokens)
            if problem is None:
                self._tokens = tokens
            elif self._tokens:
                log.warning(
                    "internal token file not taken; the tokens in force stay", extra={"reason": problem}
                )
            else:
                self._tokens = tokens  # nothing in force yet: use what is there
        return self._tokens

    def _read(self) -> tuple[str, ...]:
        assert self._path is not None
        try:
            text = self._path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read the internal token file {self._path}: {exc}") from exc
        return tuple(line.strip() for line in text.splitlines() if line.strip())


def _problem(tokens: tuple[str, ...]) -> str | None:
    """What is wrong with a set of tokens, or None. Never holds a token."""
    if not tokens:
        return "is empty"
    short = [i for i, token in enumerate(tokens) if len(token) < MIN_TOKEN_CHARS]
    if short:
        return f"on line {short[0] + 1} is shorter than {MIN_TOKEN_CHARS} characters"
    return None


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
        scheme, _, token = str(metadata.get("authorization", "")).partition(" ")
        if scheme == "Bearer" and self._tokens.accepts(token):
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
