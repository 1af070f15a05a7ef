"""Health, readiness, version, status, models, tokenize/detokenize and metrics routes."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from services.codec.backend.protocol import ServiceStatus
from services.codec.state import CodecIdentity
from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MAX_CONTEXT, MODEL_NAME, FakeBackend, identity_for, make_app, scripted

pytestmark = pytest.mark.model

USER = [{"role": "user", "content": "hi"}]
STATUS_KEYS = {
    "encoded_sequences_total",
    "encoded_tokens_total",
    "name",
    "role",
    "address",
    "ready",
    "running",
    "waiting",
    "requests_total",
    "kv_blocks",
    "prefix_cache",
}


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def identity(model_dir: Path) -> CodecIdentity:
    return identity_for(model_dir)


@pytest.fixture
def fake(identity: CodecIdentity, tokenizer: Tokenizer) -> FakeBackend:
    backend = FakeBackend(identity.tokenizer_fingerprint)
    backend.script = scripted([tokenizer.encode("Hello world")])
    return backend


@pytest.fixture
def app(tokenizer: Tokenizer, fake: FakeBackend, identity: CodecIdentity) -> FastAPI:
    return make_app(tokenizer, fake, identity)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


async def test_health_is_live(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.is_unavailable = True
    response = await client.get("/health")
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


async def test_ready_only_when_backend_answers_with_our_tokenizer(
    client: httpx.AsyncClient, fake: FakeBackend, identity: CodecIdentity, caplog: pytest.LogCaptureFixture
) -> None:
    assert (await client.get("/ready")).status_code == 200
    fake.is_unavailable = True
    assert (await client.get("/ready")).status_code == 503
    fake.is_unavailable = False
    fake.tokenizer_fingerprint = "f" * 64
    with caplog.at_level(logging.WARNING, logger="services.codec.backend.readiness"):
        for _ in range(3):
            response = await client.get("/ready")
            assert response.status_code == 503
            assert response.json()["status"] == "not_ready"
    lines = [r.getMessage() for r in caplog.records if "mismatch" in r.getMessage()]
    assert len(lines) == 1  # one clear line per change, not one per probe
    assert identity.tokenizer_fingerprint in lines[0] and "f" * 64 in lines[0]


async def test_version_names_both_fingerprints(client: httpx.AsyncClient, identity: CodecIdentity) -> None:
    await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": USER})
    body = (await client.get("/version")).json()
    assert body["version"]
    assert body["model"] == MODEL_NAME
    assert body["tokenizer_fingerprint"] == identity.tokenizer_fingerprint
    assert body["model_fingerprint"] == identity.model_fingerprint
    assert body["backend"]["tokenizer_fingerprint"] == identity.tokenizer_fingerprint


async def test_status_lists_codec_then_backend_services(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.statuses_value = [
        ServiceStatus("router-0", "router", "127.0.0.1:7000", True, requests_total=5),
        ServiceStatus(
            "worker-0",
            "colocated",
            "127.0.0.1:7001",
            True,
            running=2,
            kv_blocks={"total": 10, "active": 2, "cached": 3, "free": 5},
            prefix_cache={"queries": 4, "hits": 1},
        ),
    ]
    await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": USER})
    services = (await client.get("/status")).json()["services"]
    assert [s["name"] for s in services] == ["codec", "router-0", "worker-0"]
    assert all(set(s) == STATUS_KEYS for s in services)
    codec = services[0]
    assert (codec["role"], codec["ready"], codec["running"], codec["requests_total"]) == ("codec", True, 0, 1)
    assert codec["kv_blocks"] == {"total": 0, "active": 0, "cached": 0, "free": 0}
    assert services[1]["prefix_cache"] == {"queries": 0, "hits": 0}
    assert services[2]["kv_blocks"]["free"] == 5 and services[2]["prefix_cache"]["hits"] == 1
    fake.is_unavailable = True
    services = (await client.get("/status")).json()["services"]
    assert [(s["name"], s["ready"]) for s in services] == [("codec", False)]


async def test_tokenize_counts_what_a_request_would_send(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": USER})
    chat = (await client.post("/tokenize", json={"model": MODEL_NAME, "messages": USER})).json()
    assert chat == {
        "count": len(chat["tokens"]),
        "max_model_len": MAX_CONTEXT,
        "tokens": fake.seen[0].prompt_token_ids,
    }
    text = (await client.post("/tokenize", json={"prompt": "Hello world"})).json()
    assert text["tokens"] == tokenizer.encode("Hello world", add_special_tokens=True)
    fake.is_unavailable = True  # tokenizing needs no backend; the context is then unknown
    fresh = make_app(tokenizer, fake, identity_for_name(fake))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=fresh), base_url="http://codec") as other:
        offline = (await other.post("/tokenize", json={"prompt": "Hello"})).json()
    assert offline["max_model_len"] is None and offline["count"] == 1


def identity_for_name(fake: FakeBackend) -> CodecIdentity:
    return CodecIdentity(MODEL_NAME, fake.tokenizer_fingerprint)


async def test_detokenize_round_trips_and_checks_ids(client: httpx.AsyncClient, tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("Hello world, café!")
    response = await client.post("/detokenize", json={"tokens": token_ids})
    assert response.json() == {"prompt": "Hello world, café!"}
    response = await client.post("/detokenize", json={"tokens": [1, tokenizer.vocab_size]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tokens"
    response = await client.post("/detokenize", json={"model": "other", "tokens": [1]})
    assert response.status_code == 404


async def test_models_lists_the_served_name(client: httpx.AsyncClient) -> None:
    body = (await client.get("/v1/models")).json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL_NAME]
    assert (await client.get(f"/v1/models/{MODEL_NAME}")).status_code == 200
    missing = await client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def sample_values(text: str) -> dict[str, float]:
    """Prometheus exposition lines `name{labels} value` as a dict."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


async def test_metrics_counters_rise_by_exactly_n(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    before = sample_values((await client.get("/metrics")).text)
    for protocol in ("chat.completions", "completions", "anthropic.messages", "responses", "grpc.chat"):
        for status in ("200", "500", "503"):  # there at zero before any request: rate() sees the first one
            assert before[f'kvrelay_requests_total{{protocol="{protocol}",status="{status}"}}'] == 0.0
    num_ok, num_bad = 3, 2
    for _ in range(num_ok):
        assert (
            await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": USER})
        ).status_code == 200
    for _ in range(num_bad):
        await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": USER, "n": 0})
    await client.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "stream": True})
    after = sample_values((await client.get("/metrics")).text)

    def rise(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    num_prompt = len(fake.seen[0].prompt_token_ids)
    assert rise('kvrelay_requests_total{protocol="chat.completions",status="200"}') == num_ok
    assert rise('kvrelay_requests_total{protocol="chat.completions",status="400"}') == num_bad
    assert rise('kvrelay_requests_total{protocol="completions",status="200"}') == 1
    assert rise("kvrelay_prompt_tokens_total") == num_ok * num_prompt + 1
    assert rise("kvrelay_generation_tokens_total") == (num_ok + 1) * 3
    assert rise("kvrelay_e2e_request_latency_seconds_count") == num_ok + num_bad + 1
    assert rise("kvrelay_time_to_first_token_seconds_count") == num_ok + 1
    assert rise("kvrelay_inter_token_latency_seconds_count") == (num_ok + 1) * 2
    assert rise('kvrelay_codec_stage_seconds_count{stage="template"}') == num_ok
    assert rise('kvrelay_codec_stage_seconds_count{stage="tokenize"}') == num_ok + 1
    assert rise('kvrelay_codec_stage_seconds_count{stage="detokenize"}') == (num_ok + 1) * 3


async def test_access_log_has_ids_timings_and_counts_but_no_text(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    completion_ids = tokenizer.encode(" Zebra quartz")
    fake.script = scripted([completion_ids])
    secret = [{"role": "user", "content": "my secret prompt words"}]
    with caplog.at_level(logging.DEBUG):
        response = await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": secret})
    access = [r for r in caplog.records if r.name == "kvrelay.access"]
    assert len(access) == 1
    record = access[0].__dict__
    assert record["request_id"] == response.headers["x-request-id"]
    assert (record["route"], record["status"], record["protocol"]) == (
        "/v1/chat/completions",
        200,
        "chat.completions",
    )
    assert (
        record["prompt_tokens"] == len(fake.seen[0].prompt_token_ids)
        and record["completion_tokens"] == len(completion_ids) + 1
    )
    assert record["ttft_ms"] is not None and record["e2e_ms"] >= record["ttft_ms"]
    everything = " ".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "secret prompt" not in everything and "Zebra" not in everything


async def test_unexpected_errors_are_500_without_internals(
    client: httpx.AsyncClient, fake: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(request: object) -> list[object]:
        raise RuntimeError("db password hunter2")

    fake.script = explode  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR):
        response = await client.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": USER})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "hunter2" not in response.text
    assert response.headers["x-request-id"] in error["message"]
    assert any(getattr(r, "request_id", None) == response.headers["x-request-id"] for r in caplog.records)


@pytest.mark.parametrize("given", ["bad id with spaces", "x" * 200, "../etc", ""])
async def test_insane_client_request_ids_are_replaced(client: httpx.AsyncClient, given: str) -> None:
    response = await client.get("/health", headers={"x-request-id": given})
    assert response.headers["x-request-id"].startswith("req_")


def test_the_app_closes_its_backend_on_shutdown(app: FastAPI, fake: FakeBackend) -> None:
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        assert not fake.is_closed
    assert fake.is_closed
