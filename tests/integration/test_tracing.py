"""Tracing across processes: in disaggregated mode a codec, a router, a prefill and a decode worker (four
processes on a tiny random-weight model) export over OTLP/gRPC to a receiver this test runs, and one
request through the codec's HTTP port yields one trace with spans from all four, linked across them:

    codec   POST /v1/completions ── parse, tokenize, admission, detokenize
    router    └─ route
    decode         ├─ queue, decode
                   └─ kv_transfer
    prefill              └─ prefill
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.e2e.conftest import wait_http_ready
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "tracing-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)
SERVICES = ("kvrelay-codec", "kvrelay-router", "kvrelay-prefill", "kvrelay-decode")


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root
    attributes: dict[str, object]


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = []
        for resource_spans in request.resource_spans:
            resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    attributes = {kv.key: _value(kv.value) for kv in span.attributes}
                    received.append(
                        ReceivedSpan(
                            resource.get("service.name", ""),
                            span.name,
                            span.trace_id.hex(),
                            span.span_id.hex(),
                            span.parent_span_id.hex(),
                            attributes,
                        )
                    )
        with self._lock:
            self._spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)


def _value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, str]]:
    servicer = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"http://127.0.0.1:{port}"
    server.stop(None)


def test_one_request_is_one_trace_across_four_processes(
    tmp_path: Path, receiver: tuple[Receiver, str]
) -> None:
    spans_in, endpoint = receiver
    model = make_tiny_llama(tmp_path / "tiny")
    env = stack_env(
        TOKEN,
        KVRELAY_MODEL__DTYPE="float32",
        KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8",
        KVRELAY_DISAGGREGATION__POLICY="always",
        KVRELAY_TRACING__OTLP_ENDPOINT=endpoint,
        OTEL_BSP_SCHEDULE_DELAY="200",  # export within a fraction of a second
    )
    addresses = {role: f"127.0.0.1:{free_port()}" for role in ("prefill", "decode", "router")}
    codec_port = free_port()
    procs: dict[str, Proc] = {}
    try:
        for role in ("prefill", "decode"):
            port = addresses[role].split(":")[1]
            args = ["worker", "--model", str(model), "--role", role, "--port", port, "--threads", "1"]
            procs[role] = Proc([*args, "--name", f"{role}-0"], env, tmp_path / f"{role}.log")
        workers = f"{addresses['prefill']},{addresses['decode']}"
        router_port = addresses["router"].split(":")[1]
        procs["router"] = Proc(
            ["router", "--port", router_port, "--workers", workers], env, tmp_path / "router.log"
        )
        codec_args = ["codec", "--model", str(model), "--router", addresses["router"]]
        procs["codec"] = Proc([*codec_args, "--port", str(codec_port)], env, tmp_path / "codec.log")
        for role in ("prefill", "decode", "router"):
            wait_serving(addresses[role], procs[role])
        _wait_router_sees_both_pools(addresses["router"])
        url = f"http://127.0.0.1:{codec_port}"
        wait_http_ready(url, procs["codec"])

        prompt = " ".join(f"t{2 + i % 100}" for i in range(40))  # the tiny word tokenizer's tokens
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4

        trace = _wait_for_trace(spans_in, procs)
    finally:
        for proc in procs.values():
            proc.stop()

    by_name = {(span.service, span.name): span for span in trace}
    root = by_name[("kvrelay-codec", "POST /v1/completions")]
    route = by_name[("kvrelay-router", "route")]
    transfer = by_name[("kvrelay-decode", "kv_transfer")]
    prefill = by_name[("kvrelay-prefill", "prefill")]
    assert root.parent_span_id == ""
    for name in ("parse", "tokenize", "admission", "detokenize"):
        assert by_name[("kvrelay-codec", name)].parent_span_id == root.span_id, name
    assert route.parent_span_id == root.span_id  # codec → router, over gRPC metadata
    for name in ("queue", "kv_transfer", "decode"):
        assert by_name[("kvrelay-decode", name)].parent_span_id == route.span_id, name  # router → decode
    assert prefill.parent_span_id == transfer.span_id  # decode → prefill, over the Prefill call
    assert transfer.attributes["kvrelay.mode"] == "remote"
    assert int(str(transfer.attributes["kvrelay.kv_bytes"])) > 0
    assert route.attributes["kvrelay.disaggregation"] == "always"
    assert int(str(by_name[("kvrelay-decode", "decode")].attributes["kvrelay.generated_tokens"])) == 4


def _wait_for_trace(
    receiver: Receiver, procs: dict[str, Proc], timeout_s: float = 30.0
) -> list[ReceivedSpan]:
    """The request's trace once every expected span has arrived; exactly one trace must hold them."""
    wanted = {
        ("kvrelay-codec", "POST /v1/completions"),
        ("kvrelay-codec", "detokenize"),
        ("kvrelay-router", "route"),
        ("kvrelay-decode", "decode"),
        ("kvrelay-prefill", "prefill"),
    }
    deadline = time.monotonic() + timeout_s
    while True:
        spans = receiver.spans()
        traces = {span.trace_id for span in spans}
        if wanted <= {(span.service, span.name) for span in spans}:
            assert len(traces) == 1, f"spans in {len(traces)} traces: {spans}"
            assert {span.service for span in spans} == set(SERVICES)
            return spans
        if time.monotonic() > deadline:
            got = sorted({(s.service, s.name) for s in spans})
            logs = "\n".join(f"--- {name}\n{proc.log()[-2000:]}" for name, proc in procs.items())
            pytest.fail(f"spans missing after {timeout_s}s; got {got}\n{logs}")
        time.sleep(0.2)


def _wait_router_sees_both_pools(router_address: str) -> None:
    with grpc.insecure_channel(router_address) as channel:
        status = worker_pb2_grpc.RouterStub(channel)
        for _ in range(150):
            replicas = status.Replicas(pb.ReplicasRequest(), metadata=MD).replicas
            if sorted(r.role for r in replicas if r.ready) == ["decode", "prefill"]:
                return
            time.sleep(0.2)
    raise TimeoutError("the router never saw a ready prefill and decode replica")
