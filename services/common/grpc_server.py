"""What kvrelay's gRPC servers (the worker, with its Prefill service, and the router) share: the one mapping
of kvrelay's errors to gRPC status codes, and the shutdown: stop on SIGTERM or SIGINT, then drain.

| error (services/common/errors.py)          | status           |
|--------------------------------------------|------------------|
| InvalidRequestError and its subclasses     | INVALID_ARGUMENT |
| DuplicateRequestError                      | ALREADY_EXISTS   |
| EngineDeadError, and the caller's `unavailable` kinds (a KV transfer fault) | UNAVAILABLE |
| WorkerBusyError (a worker's waiting queue is full)  | RESOURCE_EXHAUSTED |

Draining: health checks answer NOT_SERVING at once (load balancers and the router stop sending), calls in
flight get `grace_seconds` to finish, then the server stops.
"""

from __future__ import annotations

import asyncio
import signal
from typing import NoReturn

import grpc
from grpc_health.v1 import health

from services.common.errors import (
    DuplicateRequestError,
    EngineDeadError,
    InvalidRequestError,
    WorkerBusyError,
)

# Trailing metadata that marks a RESOURCE_EXHAUSTED as "this worker's waiting queue is full" (the router
# then tries another replica; the codec answers 503), apart from gRPC's own RESOURCE_EXHAUSTED (a message
# over its size limit), which is the request's fault.
BUSY_KEY = "kvrelay-worker-busy"


def is_busy(exc: grpc.aio.AioRpcError) -> bool:
    """Whether `exc` is a full waiting queue's refusal (WorkerBusyError, relayed by the router)."""
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    return any(key == BUSY_KEY for key, _ in exc.trailing_metadata() or ())


_STATUS: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DuplicateRequestError, grpc.StatusCode.ALREADY_EXISTS),
    (EngineDeadError, grpc.StatusCode.UNAVAILABLE),
    (WorkerBusyError, grpc.StatusCode.RESOURCE_EXHAUSTED),
)


def status_of(
    exc: BaseException, unavailable: tuple[type[BaseException], ...] = ()
) -> grpc.StatusCode | None:
    """The status code `exc` answers with; None for an error this mapping does not know."""
    if isinstance(exc, unavailable):
        return grpc.StatusCode.UNAVAILABLE
    return next((status for kind, status in _STATUS if isinstance(exc, kind)), None)


async def abort_for(
    context: grpc.aio.ServicerContext, exc: BaseException, unavailable: tuple[type[BaseException], ...] = ()
) -> NoReturn:
    """End the call with `exc`'s status and message; an error the mapping does not know is raised as is
    (gRPC answers it UNKNOWN, and the server logs it)."""
    status = status_of(exc, unavailable)
    if status is None:
        raise exc
    if isinstance(exc, WorkerBusyError):
        context.set_trailing_metadata(((BUSY_KEY, "1"),))
    await context.abort(status, str(exc))
    raise AssertionError("unreachable") from exc  # context.abort raises


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def drain(
    server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, grace_seconds: float
) -> None:
    """Answer NOT_SERVING to health checks, then stop `server`, letting calls in flight finish within
    `grace_seconds`."""
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_seconds)
