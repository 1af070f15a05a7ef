"""Noticing that the HTTP client went away, so the work done for it can be stopped (and aborted inward).

After the request body is read, an ASGI `receive()` returns only `http.disconnect`, so waiting on it
beside the work tells us when the client leaves, even while nothing is being sent.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio
from starlette.requests import Request
from starlette.types import Receive

from services.codec.errors import ClientClosedError
from services.codec.generation import GenerationStream

ResultT = TypeVar("ResultT")


async def cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancels `scope` when the client disconnects. Start it only once the body has been read."""
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def unless_client_leaves(receive: Receive, work: Callable[[], Awaitable[ResultT]]) -> ResultT:
    """`work`'s result. If the client disconnects first, `work` is cancelled and ClientClosedError raised."""
    results: list[ResultT] = []
    failures: list[Exception] = []
    async with anyio.create_task_group() as group:
        group.start_soon(cancel_on_disconnect, receive, group.cancel_scope)
        try:
            results.append(await work())
        except Exception as exc:  # re-raised below, outside the task group (which would wrap it)
            failures.append(exc)
        group.cancel_scope.cancel()
    if failures:
        raise failures[0]
    if not results:
        raise ClientClosedError()
    return results[0]


async def run_unless_gone(
    request: Request, generation: GenerationStream, work: Callable[[], Awaitable[ResultT]]
) -> ResultT:
    """`work` (reading `generation` to its end) unless the client leaves first (ClientClosedError);
    either way the generation is closed, which aborts it if it still runs."""
    try:
        return await unless_client_leaves(request.receive, work)
    finally:
        await generation.aclose()
