"""Errors at the HTTP edge, in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`,
except on Anthropic's routes (/v1/messages*), where they take Anthropic's shape:
`{"type": "error", "error": {"type", "message"}, "request_id"}`, its `error.type` chosen by status.

The codec adds these leaves to the common tree (services/common/errors.py); each maps to one status:

    KvrelayError
    ├── InvalidRequestError                   400 invalid_request_error
    │   ├── ContextLengthExceededError        400 code context_length_exceeded
    │   │   └── PromptTooLongError            400 code context_length_exceeded
    │   ├── UnknownParameterError             400 code unknown_parameter
    │   ├── UnsupportedParameterError         400 code unsupported_parameter
    │   ├── MalformedBodyError                400 (not JSON, not an object, not UTF-8)
    │   ├── UnsupportedMediaTypeError         415
    │   ├── BodyTooLargeError                 413
    │   └── UnknownModelError                 404 code model_not_found, param "model"
    ├── AuthenticationError                   401 invalid_request_error, code invalid_api_key (a wrong
    │                                             key) or null (none sent), as OpenAI answers;
    │                                             Anthropic's shape: authentication_error
    ├── ObjectNotFoundError                   404 code not_found (a file or batch of no tenant's own)
    ├── ClientClosedError                     499, logged only: the client left before the response
    │   └── ClientStoppedReadingError         499, logged only: a streamed write waited too long
    ├── BackendRejectedError                  400 (the stack refused what the codec let through)
    ├── BackendUnavailableError               503 server_error + Retry-After
    │   └── StoreUnavailableError             503: stored responses, the queue or the batch store
    └── BackendFailedError                    500 before the stream; an in-band error event after
    any other exception                       500 server_error, logged with the request ID, never leaked

Admission's refusals (services/codec/admission/errors.py: 429, 503, 529 on Anthropic's routes) carry
their own wire error (`wire_error()`, the `WireMapped` protocol), which `describe` uses as it is.

`describe` is the one mapping from an exception to its wire error; the handlers `install_error_handlers`
registers (one per family: kvrelay's tree, FastAPI's validation errors, Starlette's HTTP errors), the
middleware's fallback, the public gRPC API and the in-band stream error all use it, so no route catches
an error to answer it by hand. `error_response` picks the shape (and, for a 529, the status) from the
request path when the response is sent, so the middleware's errors (413, last-resort 500) follow it too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from services.codec.backend.protocol import BackendFailedError, BackendRejectedError, BackendUnavailableError
from services.codec.metrics import STATUS_CLIENT_CLOSED
from services.common.errors import ContextLengthExceededError, InvalidRequestError, KvrelayError

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
INVALID_API_KEY = "invalid_api_key"
WWW_AUTHENTICATE = 'Bearer realm="kvrelay"'
INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_REQUEST_ID_HEADER = "request-id"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


class PromptTooLongError(ContextLengthExceededError):
    """The prompt alone is over `limits.max_input_tokens` or leaves no room in the model's context."""

    def __init__(self, num_prompt_tokens: int, limit: int, what: str, param: str) -> None:
        InvalidRequestError.__init__(
            self, f"the prompt has {num_prompt_tokens} tokens, over the {what} of {limit} tokens", param=param
        )
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = limit


class UnknownParameterError(InvalidRequestError):
    """A field this API does not define."""


class UnsupportedParameterError(InvalidRequestError):
    """A field the API defines but this server cannot honour (tools, audio, ...)."""


class MalformedBodyError(InvalidRequestError):
    """The body is not UTF-8 JSON holding an object."""


class UnsupportedMediaTypeError(InvalidRequestError):
    """The request's Content-Type is not application/json."""


class BodyTooLargeError(InvalidRequestError):
    """The request body passed `limits.max_body_bytes`."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than the limit of {limit} bytes")


class UnknownModelError(InvalidRequestError):
    def __init__(self, model: str) -> None:
        super().__init__(f"the model {model!r} does not exist", param="model")


class AuthenticationError(KvrelayError):
    """No API key, or one that is not valid (services/codec/admission/auth.py). The message never holds
    the key."""

    def __init__(self, *, is_missing: bool) -> None:
        super().__init__(
            "no API key: send it as `Authorization: Bearer <key>` or in the `x-api-key` header"
            if is_missing
            else "the API key is not valid"
        )
        self.is_missing = is_missing

    @property
    def reason(self) -> str:
        """ "missing" or "invalid": the metrics label."""
        return "missing" if self.is_missing else "invalid"


class ClientClosedError(KvrelayError):
    """The client disconnected before the response started; the request was aborted."""

    def __init__(self) -> None:
        super().__init__("the client closed the request")


class ClientStoppedReadingError(ClientClosedError):
    """One write of a streamed response waited past `limits.stream_send_timeout_ms`: the client stopped
    reading, so it counts as gone and the stream is stopped (which aborts the request behind it)."""

    def __init__(self, timeout_s: float) -> None:
        KvrelayError.__init__(self, f"the client stopped reading: a write waited over {timeout_s:g} s")


@dataclass(frozen=True)
class WireError:
    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    anthropic_status: int | None = None  # another status on Anthropic's routes (529 for overloaded)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self, request_id: str | None = None) -> dict[str, Any]:
        """Anthropic's shape, which has no `param`: the message names it instead. The in-band stream
        error event carries no `request_id`."""
        message = self.message
        if self.param and self.param not in message:
            message = f"{self.param}: {message}"
        body: dict[str, Any] = {
            "type": "error",
            "error": {"type": anthropic_error_type(self.anthropic_status or self.status), "message": message},
        }
        if request_id is not None:
            body["request_id"] = request_id
        return body


class StoreUnavailableError(BackendUnavailableError):
    """A store the codec keeps state in did not answer (stored responses, the queue, the batch store):
    503 with Retry-After, naming what cannot be served now (`what`)."""

    what = "stored state is"

    def wire_error(self) -> WireError:
        message = f"{self.what} unavailable now (the store does not answer); retry later"
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        return WireError(503, message, SERVER_ERROR, code="service_unavailable", headers=headers)


class ObjectNotFoundError(KvrelayError):
    """A file, batch or stored object this tenant does not have (another tenant's reads the same): 404."""

    def __init__(self, what: str, object_id: str, param: str | None = None) -> None:
        super().__init__(f"No {what} with id {object_id!r} found.")
        self.param = param

    def wire_error(self) -> WireError:
        return WireError(404, str(self), INVALID_REQUEST, self.param, "not_found")


@runtime_checkable
class WireMapped(Protocol):
    """An error that knows its own wire form (admission's refusals)."""

    def wire_error(self) -> WireError: ...


def anthropic_error_type(status: int) -> str:
    """Anthropic's `error.type` for an HTTP status; unlisted 4xx are invalid requests, 5xx API errors."""
    return _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(f"{ANTHROPIC_PATH}/")


_INVALID_STATUS: tuple[tuple[type[InvalidRequestError], int, str | None], ...] = (
    (ContextLengthExceededError, 400, "context_length_exceeded"),
    (UnknownParameterError, 400, "unknown_parameter"),
    (UnsupportedParameterError, 400, "unsupported_parameter"),
    (UnsupportedMediaTypeError, 415, None),
    (BodyTooLargeError, 413, None),
    (UnknownModelError, 404, "model_not_found"),
)


def describe(exc: BaseException, request_id: str = "") -> WireError:
    """The wire error for `exc`. Unexpected exceptions get a generic message; log them separately."""
    if isinstance(exc, WireMapped):
        return exc.wire_error()
    if isinstance(exc, InvalidRequestError):
        for cls, status, code in _INVALID_STATUS:
            if isinstance(exc, cls):
                return WireError(status, str(exc), INVALID_REQUEST, exc.param, code)
        return WireError(400, str(exc), INVALID_REQUEST, exc.param)
    if isinstance(exc, AuthenticationError):
        code = None if exc.is_missing else INVALID_API_KEY
        headers = {"WWW-Authenticate": WWW_AUTHENTICATE}
        return WireError(401, str(exc), INVALID_REQUEST, code=code, headers=headers)
    if isinstance(exc, ClientClosedError):
        return WireError(STATUS_CLIENT_CLOSED, str(exc), INVALID_REQUEST)
    if isinstance(exc, BackendRejectedError):
        return WireError(400, f"the request was rejected: {exc}", INVALID_REQUEST)
    if isinstance(exc, BackendUnavailableError):
        return WireError(
            503,
            "no worker can take the request now; retry later",
            SERVER_ERROR,
            code="service_unavailable",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    suffix = f" (request {request_id})" if request_id else ""
    if isinstance(exc, BackendFailedError):
        return WireError(500, f"generation failed in the serving stack{suffix}", SERVER_ERROR)
    return WireError(500, f"internal server error{suffix}", SERVER_ERROR)


def is_expected(exc: BaseException) -> bool:
    """Whether `exc` is a known outcome (no traceback needed in the log)."""
    expected = (
        InvalidRequestError,
        AuthenticationError,
        ClientClosedError,
        BackendRejectedError,
        BackendUnavailableError,
    )
    return isinstance(exc, (*expected, WireMapped))


class ErrorResponse(JSONResponse):
    """A JSON error in OpenAI's shape, or in Anthropic's (plus a `request-id` header) when the request's
    path is one of Anthropic's routes; the path is read from the ASGI scope when the response is sent."""

    def __init__(self, error: WireError, headers: dict[str, str] | None = None) -> None:
        self.error = error
        super().__init__(error.body(), status_code=error.status, headers={**error.headers, **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if is_anthropic_path(str(scope.get("path", ""))):
            request_id = str(scope.get("state", {}).get("request_id", ""))
            self.status_code = self.error.anthropic_status or self.status_code
            self.body = self.render(self.error.anthropic_body(request_id))
            self.headers["content-length"] = str(len(self.body))
            self.headers[ANTHROPIC_REQUEST_ID_HEADER] = request_id
        await super().__call__(scope, receive, send)


def error_response(error: WireError, headers: dict[str, str] | None = None) -> JSONResponse:
    return ErrorResponse(error, headers)


def _request_id(request: Request) -> str:
    return str(getattr(request.state, "request_id", ""))


async def _on_kvrelay_error(request: Request, exc: Exception) -> Response:
    request_id = _request_id(request)
    if not is_expected(exc):
        logger.error("request failed: %s", type(exc).__name__, exc_info=exc, extra={"request_id": request_id})
    return error_response(describe(exc, request_id))


async def _on_validation_error(request: Request, exc: Exception) -> Response:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    first = errors[0] if errors else {}
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid request')}" if param else "invalid request"
    return error_response(WireError(400, message, INVALID_REQUEST, param))


async def _on_http_exception(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, StarletteHTTPException) else 500
    detail = exc.detail if isinstance(exc, StarletteHTTPException) else "error"
    kind = INVALID_REQUEST if status < 500 else SERVER_ERROR
    message = f"{detail}: {request.method} {request.url.path}"
    return error_response(WireError(status, message, kind), headers=getattr(exc, "headers", None))


def install_error_handlers(app: FastAPI) -> None:
    """Every error the routes raise becomes OpenAI's (or Anthropic's) shape; FastAPI's 422 never does."""
    app.add_exception_handler(KvrelayError, _on_kvrelay_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
