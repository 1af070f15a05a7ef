"""Tracing (services/common/tracing.py): off unless configured and then a no-op at every call site; on, the
W3C context crosses gRPC metadata, and one codec request makes one trace of parse, tokenize, admission
and detokenize spans under the request's span, whose context the backend call carries on."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.codec.backend.protocol import GenerationRequest, TokenDelta
from services.codec.text.tokenizer import Tokenizer
from services.common import tracing
from services.common.config import TracingConfig, load_config
from services.common.errors import ConfigError
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Tracing on for the test, into memory; off again afterwards."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing.install(provider)
    yield memory
    tracing.shutdown_tracing()


def test_off_by_default_and_every_call_is_a_no_op() -> None:
    assert load_config(env={}).tracing.otlp_endpoint is None
    assert tracing.setup_tracing(TracingConfig(), "codec") is False
    assert not tracing.enabled()
    assert not isinstance(trace.get_tracer_provider(), SdkTracerProvider)  # nothing installed globally
    metadata = (("authorization", "Bearer x"), ("x-request-id", "r1"))
    assert tracing.inject(metadata) == metadata
    assert tracing.extract([("traceparent", "00-" + "1" * 32 + "-" + "2" * 16 + "-01")]) is None
    assert tracing.span("parse") is tracing.NO_SPAN
    assert tracing.start_span("queue") is trace.INVALID_SPAN
    assert tracing.current_context() is None
    stage = tracing.RepeatedStage("detokenize", tracing.current_context())
    with stage.run():
        pass
    stage.end()
    tracing.shutdown_tracing()  # safe when off


def test_otel_sdk_disabled_keeps_tracing_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    config = TracingConfig(otlp_endpoint="http://127.0.0.1:4317")
    assert tracing.setup_tracing(config, "router", exporter=InMemorySpanExporter()) is False
    assert not tracing.enabled()


def test_endpoint_from_env_and_checked() -> None:
    cfg = load_config(env={"KVRELAY_TRACING__OTLP_ENDPOINT": "http://collector:4317"})
    assert cfg.tracing.otlp_endpoint == "http://collector:4317"
    assert load_config(env={"KVRELAY_TRACING__OTLP_ENDPOINT": ""}).tracing.otlp_endpoint is None
    with pytest.raises(ConfigError, match=r"tracing\.otlp_endpoint: must be http://HOST:PORT"):
        load_config(env={"KVRELAY_TRACING__OTLP_ENDPOINT": "collector:4317"})
    with pytest.raises(ConfigError, match=r"tracing\.sample_ratio"):
        load_config(env={"KVRELAY_TRACING__SAMPLE_RATIO": "1.5"})


def test_setup_names_the_service_by_role_and_flushes_on_shutdown() -> None:
    memory = InMemorySpanExporter()
    config = TracingConfig(otlp_endpoint="http://127.0.0.1:4317", service_name_prefix="kv")
    assert tracing.setup_tracing(config, "decode", instance="decode-0", exporter=memory)
    try:
        tracing.start_span("queue").end()
        assert memory.get_finished_spans() == ()  # batched, not sent yet
    finally:
        tracing.shutdown_tracing()
    (span,) = memory.get_finished_spans()
    assert span.resource.attributes["service.name"] == "kv-decode"
    assert span.resource.attributes["service.instance.id"] == "decode-0"
    assert not tracing.enabled()


def test_context_crosses_grpc_metadata(exporter: InMemorySpanExporter) -> None:
    parent = tracing.start_span("route")
    metadata = tracing.inject((("authorization", "Bearer x"),), parent)
    keys = [key for key, _ in metadata]
    assert keys[0] == "authorization" and "traceparent" in keys
    assert all(key == key.lower() for key in keys)
    child = tracing.start_span("queue", tracing.extract(metadata))
    child.end()
    parent.end()
    finished = {span.name: span for span in exporter.get_finished_spans()}
    assert finished["queue"].context.trace_id == finished["route"].context.trace_id
    assert finished["queue"].parent is not None
    assert finished["queue"].parent.span_id == finished["route"].context.span_id
    # No traceparent: a new trace starts.
    orphan = tracing.start_span("prefill", tracing.extract([("authorization", "Bearer x")]))
    orphan.end()
    assert orphan.get_span_context().trace_id != finished["route"].context.trace_id


class RecordingBackend(FakeBackend):
    """Records the metadata a gRPC backend would send (tracing.inject at the moment the call starts)."""

    injected: list[dict[str, str]]

    async def generate(self, request: GenerationRequest) -> AsyncIterator[TokenDelta]:
        self.injected.append(dict(tracing.inject(())))
        async for delta in super().generate(request):
            yield delta


@pytest.mark.model
@pytest.mark.parametrize("stream", [False, True])
async def test_one_codec_request_is_one_trace(
    model_dir: Path, exporter: InMemorySpanExporter, stream: bool
) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    backend = RecordingBackend(identity_for(model_dir).tokenizer_fingerprint)
    backend.injected = []
    backend.script = scripted([tokenizer.encode(" one two three four")])
    app = make_app(tokenizer, backend, identity_for(model_dir))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://codec") as client:
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "stream": stream}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 200
        assert (await client.get("/health")).status_code == 200  # probes make no trace
    spans = exporter.get_finished_spans()
    by_name: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (root,) = by_name.pop("POST /v1/chat/completions")
    assert root.parent is None and root.kind == trace.SpanKind.SERVER
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 200
    assert sorted(by_name) == ["admission", "detokenize", "parse", "template", "tokenize"]
    for (span,) in by_name.values():  # one of each, all children of the request's span
        assert span.context.trace_id == root.context.trace_id
        assert span.parent is not None and span.parent.span_id == root.context.span_id
    (detokenize,) = by_name["detokenize"]
    assert detokenize.attributes is not None and int(str(detokenize.attributes["kvrelay.runs"])) >= 4
    # The backend call carries the request's span on: the router's span will be its child.
    (sent,) = backend.injected
    _version, trace_id, span_id, _flags = sent["traceparent"].split("-")
    assert int(trace_id, 16) == root.context.trace_id and int(span_id, 16) == root.context.span_id
