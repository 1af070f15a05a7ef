"""The decode (or colocated) worker's spans of one request, under the router's span (docs/observability.md):

    queue         arrival until the engine has taken the request: its first output when the prompt is
                  prefilled here, its block reservation when the KV is pulled from a prefill replica
    kv_transfer   the Prefill call: P's first token, then the KV chunks until installed, or the fallback
                  (the prefill replica's "prefill" span is its child)
    decode        from the first output (local prefill) or the installed KV until the request ends
    encode        an encoder-decoder request's encoder pass here (its batch's, timed by the engine); a
                  prefill replica's "prefill" span holds its own (services/prefill/prefill_service.py)

Never made current: the Generate stream is an async generator (services/common/tracing.py). With tracing
off every span is the API's invalid span, so each call here does nothing.
"""

from __future__ import annotations

from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind

from services.common import tracing


class RequestTrace:
    def __init__(self, parent: Context | None, request_id: str, num_prompt_tokens: int) -> None:
        self._parent = parent
        self._request_id = request_id
        self._queue: Span | None = tracing.start_span(
            "queue",
            parent,
            attributes={"kvrelay.request_id": request_id, "kvrelay.prompt_tokens": num_prompt_tokens},
        )
        self._transfer: Span | None = None
        self._decode: Span | None = None

    def taken(self) -> None:
        """The engine has the request: the queue span ends (once)."""
        queue, self._queue = self._queue, None
        if queue is not None:
            queue.end()

    def transfer_started(self, prefill_address: str, num_skip_tokens: int) -> Span:
        """The kv_transfer span, started now; `inject` it into the Prefill call's metadata."""
        self.taken()
        self._transfer = tracing.start_span(
            "kv_transfer",
            self._parent,
            kind=SpanKind.CLIENT,
            attributes={
                "kvrelay.request_id": self._request_id,
                "kvrelay.prefill_address": prefill_address,
                "kvrelay.skipped_tokens": num_skip_tokens,
            },
        )
        return self._transfer

    def transfer_ended(
        self, mode: str, num_bytes: int = 0, num_cached_tokens: int = 0, failure: str | None = None
    ) -> None:
        """The KV is installed ("remote"), or the transfer failed and the prompt is recomputed here
        ("fallback", with the reason)."""
        transfer, self._transfer = self._transfer, None
        if transfer is None:
            return
        if transfer.is_recording():
            transfer.set_attributes(
                {
                    "kvrelay.mode": mode,
                    "kvrelay.kv_bytes": num_bytes,
                    "kvrelay.cached_tokens": num_cached_tokens,
                }
            )
        tracing.finish(transfer, failure)

    def encoded(self, started_ns: int, ended_ns: int, num_source_tokens: int) -> None:
        """The engine ran this request's encoder from `started_ns` to `ended_ns` (wall clock)."""
        encode_span(self._parent, self._request_id, started_ns, ended_ns, num_source_tokens)

    def decoding(self) -> None:
        """Decoding starts now (the first local output, or the installed KV); once."""
        self.taken()
        if self._decode is None:
            self._decode = tracing.start_span(
                "decode", self._parent, attributes={"kvrelay.request_id": self._request_id}
            )

    def close(self, num_tokens: int, error: BaseException | None = None) -> None:
        """Ends every span still open (an error marks them failed)."""
        decode, self._decode = self._decode, None
        if decode is not None and decode.is_recording():
            decode.set_attribute("kvrelay.generated_tokens", num_tokens)
        for span in (self._queue, self._transfer, decode):
            if span is not None:
                tracing.finish(span, error)
        self._queue = self._transfer = None


def encode_span(
    parent: Context | None, request_id: str, started_ns: int, ended_ns: int, num_source_tokens: int
) -> None:
    """An "encode" span under `parent`, over an encoder pass the engine timed."""
    attributes: dict[str, str | int] = {
        "kvrelay.request_id": request_id,
        "kvrelay.source_tokens": num_source_tokens,
    }
    span = tracing.start_span("encode", parent, attributes=attributes, start_time_ns=started_ns)
    span.end(end_time=ended_ns)
