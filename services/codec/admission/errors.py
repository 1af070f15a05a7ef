"""Refusals of admission control (quotas and the fair queue), with their wire errors.

    KvrelayError
    ├── AdmissionRefusedError           refused before the backend saw the request; Retry-After
    │   ├── RateLimitedError            429: a requests- or tokens-per-minute window has no room
    │   ├── OverloadedError             503 (529 overloaded_error on Anthropic's routes): queue full,
    │   │                               pushed out of it by a fairer share, or waited past the deadline
    │   └── QuotaUnavailableError       503: the quota store (Redis) is down and quotas.fail_open is off
    └── BackendFailedError              (backend/protocol.py)
        └── StepTimeoutError            no token for limits.step_timeout_ms: the request is aborted
                                        (raised by generation.py, defined beside BackendFailedError)

Each refusal carries its wire error (`wire_error`, services/codec/errors.py's `WireMapped`), which the
codec's one mapping, `errors.describe`, returns as it is: the registered error handler answers a refusal
raised anywhere in a route, in OpenAI's or Anthropic's shape by path (with 529 for overloaded on
Anthropic's routes), and no route catches one by hand.
"""

from __future__ import annotations

import math
from typing import Literal

from services.codec.errors import RETRY_AFTER_S, SERVER_ERROR, WireError
from services.common.errors import KvrelayError

STATUS_TOO_MANY_REQUESTS = 429
STATUS_UNAVAILABLE = 503
STATUS_ANTHROPIC_OVERLOADED = 529  # Anthropic's "overloaded_error"
RATE_LIMIT_CODE = "rate_limit_exceeded"

QuotaMetric = Literal["requests", "tokens"]


class AdmissionRefusedError(KvrelayError):
    """Admission control refused the request before any backend work; the client may retry later."""

    status = STATUS_UNAVAILABLE

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = max(1, math.ceil(retry_after_s))  # Retry-After is whole seconds, at least 1

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}

    def wire_error(self) -> WireError:
        return WireError(
            self.status, str(self), SERVER_ERROR, code="service_unavailable", headers=self.headers
        )


class RateLimitedError(AdmissionRefusedError):
    """A quota window (`metric` per minute, for the tenant or for everyone) has no room for the request.

    The body follows OpenAI's: `type` is "requests" or "tokens", `code` "rate_limit_exceeded"."""

    status = STATUS_TOO_MANY_REQUESTS

    def __init__(self, message: str, retry_after_s: float, *, metric: QuotaMetric, reason: str) -> None:
        super().__init__(message, retry_after_s)
        self.metric = metric
        self.reason = reason  # which window: e.g. "tenant_tokens_per_minute" (the metrics label)

    def wire_error(self) -> WireError:
        return WireError(self.status, str(self), self.metric, code=RATE_LIMIT_CODE, headers=self.headers)


class OverloadedError(AdmissionRefusedError):
    """Saturation: the fair queue is full (or the wait for a slot outlived the request's deadline)."""

    def __init__(self, message: str, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.reason = reason

    def wire_error(self) -> WireError:
        return WireError(
            STATUS_UNAVAILABLE,
            str(self),
            SERVER_ERROR,
            code="overloaded",
            headers=self.headers,
            anthropic_status=STATUS_ANTHROPIC_OVERLOADED,
        )


class QuotaUnavailableError(AdmissionRefusedError):
    """The shared quota store cannot be reached and the configuration says to fail closed."""
