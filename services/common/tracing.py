"""Distributed tracing (docs/observability.md#tracing): one trace per request across codec, router,
prefill and decode, exported over OTLP/gRPC, with the W3C trace context carried in gRPC metadata.

Off unless `tracing.otlp_endpoint` is set. Off, nothing is installed: `span` hands back one shared
no-op context manager, `start_span` the API's invalid span (whose methods do nothing), `inject` returns
the metadata it was given and `extract` returns None, so the call sites cost a branch each.

On, `setup_tracing` installs this process's TracerProvider (service.name `<prefix>-<role>`) with a
BatchSpanProcessor over the OTLP/gRPC exporter (the standard `OTEL_BSP_*` and `OTEL_EXPORTER_OTLP_*`
variables still tune them: batching, headers, timeout, compression, certificates), sampling
`ParentBased(TraceIdRatioBased(sample_ratio))`, so every process follows the codec's decision.
`shutdown_tracing` flushes what is buffered; each server calls it on its way out.

The provider is kept here rather than installed globally, so a test can install and remove one.
Spans that live inside async generators (the gRPC streams) are started with an explicit parent and are
never made current: a generator may be resumed from another context, where detaching would fail.

Torch-free: the codec and router import this.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context, get_current
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from services.common.config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "kvrelay"
SHUTDOWN_TIMEOUT_S = 5.0  # the most a process waits at exit for its last spans to be exported
TRACE_KEYS = ("traceparent", "tracestate")  # W3C TraceContext, lowercase as gRPC metadata requires
Metadata = tuple[tuple[str, str], ...]
Attributes = Mapping[str, str | bool | int | float]

_PROPAGATOR = TraceContextTextMapPropagator()
# What `span` gives when tracing is off; reusable, as nullcontext keeps no state.
NO_SPAN: AbstractContextManager[Span] = nullcontext(INVALID_SPAN)
_NOOP: AbstractContextManager[None] = nullcontext()
_tracer: Tracer | None = None
_provider: TracerProvider | None = None


def service_name(config: TracingConfig, role: str) -> str:
    """`kvrelay-codec`, `kvrelay-router`, `kvrelay-prefill`, `kvrelay-decode`, `kvrelay-colocated`."""
    return f"{config.service_name_prefix}-{role}"


def setup_tracing(
    config: TracingConfig,
    role: str,
    *,
    instance: str | None = None,
    exporter: SpanExporter | None = None,
) -> bool:
    """Install this process's tracer when `config.otlp_endpoint` is set (or `exporter` is given, for
    tests); returns whether tracing is on. OTEL_SDK_DISABLED=true keeps it off."""
    if config.otlp_endpoint is None and exporter is None:
        return False
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        log.info("tracing configured but OTEL_SDK_DISABLED=true: off")
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=config.otlp_endpoint)
    attributes: dict[str, str] = {"service.name": service_name(config, role), "kvrelay.role": role}
    if instance:
        attributes["service.instance.id"] = instance
    provider = TracerProvider(
        resource=Resource.create(attributes),
        sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(exporter))
    install(provider)
    log.info(
        "tracing on",
        extra={
            "otlp_endpoint": config.otlp_endpoint,
            "service_name": attributes["service.name"],
            "sample_ratio": config.sample_ratio,
        },
    )
    return True


def install(provider: TracerProvider | None) -> None:
    """Make `provider` this process's tracer (None: tracing off). Replaces, without shutting down, any
    earlier one."""
    global _tracer, _provider
    _provider = provider
    _tracer = None if provider is None else provider.get_tracer(INSTRUMENTATION_NAME)


def shutdown_tracing(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Export what is buffered and stop the exporter, waiting at most `timeout_s` (a receiver that is down
    does not hold up the exit); tracing is off afterwards. Safe when off."""
    provider = _provider
    install(None)
    if provider is None:
        return
    flusher = threading.Thread(target=provider.shutdown, name="kvrelay-tracing-shutdown", daemon=True)
    flusher.start()
    flusher.join(timeout_s)
    if flusher.is_alive():
        log.warning("tracing: spans not exported within %.1f s of shutdown; dropping them", timeout_s)


def enabled() -> bool:
    return _tracer is not None


def span(
    name: str,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    context: Context | None = None,
) -> AbstractContextManager[Span]:
    """A span made current for the `with` block (under `context`, else the current span). An exception
    leaving the block is recorded and sets the status to error. Only in coroutines and plain code, never
    across a `yield` of an async generator (see the module doc)."""
    tracer = _tracer
    if tracer is None:
        return NO_SPAN
    return tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes)


def start_span(
    name: str,
    context: Context | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Attributes | None = None,
    start_time_ns: int | None = None,
) -> Span:
    """A started span that is not made current; the caller ends it (`end`, or `finish`). Parent:
    `context` (from `extract` or `current_context`), else the current span."""
    tracer = _tracer
    if tracer is None:
        return INVALID_SPAN
    return tracer.start_span(
        name, context=context, kind=kind, attributes=attributes, start_time=start_time_ns
    )


def finish(span_: Span, error: BaseException | str | None = None) -> None:
    """End `span_`, marking it failed when `error` is given."""
    if error is not None and span_.is_recording():
        fail(span_, error)
    span_.end()


def fail(span_: Span, error: BaseException | str) -> None:
    """Mark `span_` failed: an exception is recorded as an event, a string becomes the description."""
    if not span_.is_recording():
        return
    if isinstance(error, BaseException):
        span_.record_exception(error)
        span_.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    else:
        span_.set_status(Status(StatusCode.ERROR, error))


def current_context() -> Context | None:
    """The current context (None when tracing is off), to parent spans started later elsewhere."""
    if _tracer is None:
        return None
    return get_current()


def inject(metadata: Sequence[tuple[str, str]], parent: Span | Context | None = None) -> Metadata:
    """`metadata` plus `traceparent` (and `tracestate`) for `parent` (a span, a context, or by default the
    current span). Unchanged when tracing is off or there is no valid span to continue."""
    if _tracer is None:
        return tuple(metadata)
    context = trace.set_span_in_context(parent) if isinstance(parent, Span) else parent
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=context)
    return (*metadata, *((key, carrier[key]) for key in TRACE_KEYS if key in carrier))


def extract(metadata: Iterable[Any] | None) -> Context | None:
    """The caller's trace context from gRPC invocation metadata ((key, value) pairs); None when tracing
    is off. Without a valid `traceparent` the context is empty, and spans under it start a new trace."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if key in TRACE_KEYS and isinstance(value, str):
            carrier[key] = value
    return _PROPAGATOR.extract(carrier)


class RepeatedStage:
    """One span for a stage that runs many times per request (the codec's detokenize runs once per token
    delta): it starts when the stage first runs and ends when it last finished, under `parent`, with the
    number of runs and the time spent in them (`kvrelay.runs`, `kvrelay.busy_ms`). Inactive (every call
    a no-op) when `parent` is None, as `current_context()` is when tracing is off."""

    def __init__(self, name: str, parent: Context | None) -> None:
        self._name = name
        self._parent = parent
        self._span: Span | None = None
        self._num_runs = 0
        self._busy_ns = 0
        self._last_end_ns = 0

    def run(self) -> AbstractContextManager[None]:
        """Times one run of the stage (the `with` block)."""
        if self._parent is None:
            return _NOOP
        return self._timed()

    @contextmanager
    def _timed(self) -> Iterator[None]:
        started_ns = time.time_ns()
        try:
            yield
        finally:
            ended_ns = time.time_ns()
            if self._span is None:
                self._span = start_span(self._name, self._parent, start_time_ns=started_ns)
            self._num_runs += 1
            self._busy_ns += ended_ns - started_ns
            self._last_end_ns = ended_ns

    def end(self) -> None:
        """Ends the span at the end of the last run (nothing if the stage never ran). Idempotent."""
        span_, self._span = self._span, None
        if span_ is None:
            return
        span_.set_attribute("kvrelay.runs", self._num_runs)
        span_.set_attribute("kvrelay.busy_ms", round(self._busy_ns / 1e6, 3))
        span_.end(end_time=self._last_end_ns)
