"""API keys (services/codec/admission/auth.py): the key store and its reloads, 401s in each protocol's
shape, the tenant on the request (stored responses, audit line, per-tenant prefix-cache counters), the
public gRPC API's interceptor, open mode, and the internal token's reload from its file."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import httpx2
import openai
import pytest
from fastapi import FastAPI
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.codec.admission import auth as auth_module
from services.codec.admission.auth import (
    Authenticator,
    KeyRecord,
    KeyStore,
    key_digest,
    key_id_of,
    new_key,
    read_keys_file,
    rpc_tenant,
    write_keys_file,
)
from services.codec.errors import AuthenticationError
from services.codec.grpc_public.server import PublicGrpcServer
from services.codec.server import log_auth_mode
from services.codec.state import CodecIdentity, CodecState
from services.codec.text.tokenizer import Tokenizer
from services.common.config import AuthConfig, KvrelayConfig
from services.common.errors import ConfigError
from services.common.grpc_auth import InternalTokenInterceptor, TokenSource
from services.common.tenants import DEFAULT_TENANT, cache_salt
from services.proto_gen.kvrelay.v1 import public_pb2 as pb
from services.proto_gen.kvrelay.v1 import public_pb2_grpc
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted, serve_in_thread

CANARY = "zebra-canary-7f3e91"
USER = [{"role": "user", "content": f"Say hello. {CANARY}"}]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def add_key(path: Path, tenant: str) -> tuple[str, str]:
    """Appends a fresh key for `tenant` to the keys file; (key ID, key)."""
    records = read_keys_file(path) if path.exists() else []
    key_id, key = new_key()
    write_keys_file(path, [*records, KeyRecord(key_id=key_id, tenant=tenant, sha256=key_digest(key))])
    return key_id, key


def remove_key(path: Path, key_id: str) -> None:
    write_keys_file(path, [r for r in read_keys_file(path) if r.key_id != key_id])


# ---- keys and the key store ----------------------------------------------------------------------------


def test_a_key_names_its_id_and_the_file_holds_only_its_digest(tmp_path: Path) -> None:
    key_id, key = new_key()
    assert key.startswith(f"kvr-{key_id}-") and key_id_of(key) == key_id
    assert key_id_of("kvr-abc") is None and key_id_of("sk-abc-def") is None and key_id_of("") is None
    path = tmp_path / "keys.yaml"
    write_keys_file(path, [KeyRecord(key_id=key_id, tenant="acme", sha256=key_digest(key))])
    text = path.read_text()
    assert key not in text and key.rsplit("-", 1)[-1] not in text
    assert key_digest(key) in text
    assert path.stat().st_mode & 0o777 == 0o600


def test_the_store_maps_keys_to_tenants_and_refuses_the_rest(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    id_a, key_a = add_key(path, "acme")
    _, key_b = add_key(path, "beta")
    store = KeyStore(path)
    tenant = store.tenant_for(key_a)
    assert tenant is not None and (tenant.tenant_id, tenant.key_id) == ("acme", id_a)
    assert tenant.cache_salt == cache_salt("acme")
    assert store.tenant_for(key_b) is not None and store.tenant_for(key_b).tenant_id == "beta"  # type: ignore[union-attr]
    assert store.tenant_for(key_a[:-1] + ("A" if key_a[-1] != "A" else "B")) is None  # wrong secret
    assert store.tenant_for(f"kvr-{'0' * 12}-{key_a.split('-', 2)[2]}") is None  # unknown key ID
    assert store.tenant_for("not-a-key") is None
    assert store.tenant_for("") is None


def test_keys_are_compared_in_constant_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keys.yaml"
    _, key = add_key(path, "acme")
    store = KeyStore(path)
    calls: list[tuple[bytes, bytes]] = []
    real = auth_module.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", spy)
    for given in (key, key + "x", "kvr-000000000000-secret", "garbage"):
        store.tenant_for(given)
    assert len(calls) == 4  # every attempt, known key ID or not, goes through compare_digest
    assert all(len(a) == len(b) == 32 for a, b in calls)  # of SHA-256 digests, never the raw keys


def test_the_store_reloads_a_changed_file_at_most_once_a_second(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    id_a, key_a = add_key(path, "acme")
    clock = Clock()
    store = KeyStore(path, clock=clock)
    store.tenant_for(key_a)
    _, key_b = add_key(path, "beta")
    clock.now += 0.5
    assert store.tenant_for(key_b) is None  # not looked at again yet
    clock.now += 0.6
    assert store.tenant_for(key_b) is not None  # added without a restart
    remove_key(path, id_a)
    clock.now += 1.1
    assert store.tenant_for(key_a) is None  # revoked without a restart
    assert store.num_keys == 1


def test_a_broken_file_keeps_the_last_good_keys(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys.yaml"
    _, key = add_key(path, "acme")
    clock = Clock()
    store = KeyStore(path, clock=clock)
    path.write_text("keys: [{key_id: x")  # a half-written file
    clock.now += 2
    with caplog.at_level(logging.ERROR, logger="services.codec.admission.auth"):
        assert store.tenant_for(key) is not None
    assert "keeping the last good keys" in caplog.text
    path.unlink()
    clock.now += 2
    assert store.tenant_for(key) is not None
    _, key_b = add_key(path, "beta")
    clock.now += 2
    assert store.tenant_for(key_b) is not None and store.tenant_for(key) is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("keys:\n- {key_id: abc, tenant: acme, sha256: nothex}\n", "sha256"),
        ("keys:\n- {key_id: abc, tenant: acme, key: kvr-abc-secret, sha256: " + "0" * 64 + "}\n", "key"),
        ("keys:\n- {key_id: a-b, tenant: acme, sha256: " + "0" * 64 + "}\n", "key_id"),
        ("keys:\n- {key_id: abc, tenant: 'a b', sha256: " + "0" * 64 + "}\n", "tenant"),
        ("[1, 2]\n", "invalid"),
        (
            "keys: [{key_id: a, tenant: t, sha256: "
            + "a" * 64
            + "}, {key_id: a, tenant: u, sha256: "
            + "b" * 64
            + "}]\n",
            "twice",
        ),
    ],
)
def test_an_invalid_keys_file_is_a_config_error(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        KeyStore(path)


def test_a_missing_keys_file_at_start_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot be read"):
        Authenticator.from_config(AuthConfig(keys_file=str(tmp_path / "absent.yaml")))


def test_json_keys_files_are_read_and_written(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    _, key = add_key(path, "acme")
    assert json.loads(path.read_text())["keys"][0]["tenant"] == "acme"
    assert KeyStore(path).tenant_for(key) is not None


def test_shared_cache_groups_share_a_salt_and_no_one_else_does(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    keys = {tenant: add_key(path, tenant)[1] for tenant in ("a", "b", "c")}
    store = KeyStore(path, [["a", "b"]])
    salts = {tenant: store.tenant_for(key).cache_salt for tenant, key in keys.items()}  # type: ignore[union-attr]
    assert salts["a"] == salts["b"] != salts["c"]
    assert salts["c"] != cache_salt(DEFAULT_TENANT)


@pytest.mark.parametrize(
    ("authorization", "api_key", "is_missing"),
    [
        (None, None, True),
        (None, "", True),
        ("Basic abc", None, False),
        ("Bearer ", None, False),
        ("Bearer kvr-x-y", "kvr-x-z", False),  # two different keys
    ],
)
def test_what_counts_as_no_key_or_a_bad_one(
    tmp_path: Path, authorization: str | None, api_key: str | None, is_missing: bool
) -> None:
    path = tmp_path / "keys.yaml"
    add_key(path, "acme")
    authenticator = Authenticator(KeyStore(path))
    with pytest.raises(AuthenticationError) as caught:
        authenticator.authenticate(authorization, api_key)
    assert caught.value.is_missing is is_missing


def test_open_mode_is_tenant_default_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    authenticator = Authenticator.from_config(AuthConfig())
    assert authenticator.is_open
    tenant = authenticator.authenticate(None, "anything")
    assert (tenant.tenant_id, tenant.key_id) == (DEFAULT_TENANT, None)
    with caplog.at_level(logging.INFO, logger="services.codec.server"):
        log_auth_mode(authenticator)
    assert "open mode: no API keys, every request is tenant default" in caplog.text


# ---- the HTTP app with keys -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def identity(model_dir: Path) -> CodecIdentity:
    return identity_for(model_dir)


@pytest.fixture
def fake(identity: CodecIdentity, tokenizer: Tokenizer) -> FakeBackend:
    backend = FakeBackend(identity.tokenizer_fingerprint)
    backend.script = scripted([tokenizer.encode("Hello world")], num_cached_tokens=16)
    return backend


@pytest.fixture
def keys_path(tmp_path: Path) -> Path:
    return tmp_path / "keys.yaml"


@pytest.fixture
def keys(keys_path: Path) -> dict[str, str]:
    return {tenant: add_key(keys_path, tenant)[1] for tenant in ("acme", "beta")}


@pytest.fixture
def app(
    tokenizer: Tokenizer, fake: FakeBackend, identity: CodecIdentity, keys_path: Path, keys: dict[str, str]
) -> FastAPI:
    config = KvrelayConfig(auth=AuthConfig(keys_file=str(keys_path)))
    return make_app(tokenizer, fake, identity, config)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


CHAT = {"model": MODEL_NAME, "messages": USER, "max_tokens": 4}
ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/completions", {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4}),
    ("POST", "/v1/responses", {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4}),
    ("GET", "/v1/responses/resp_123", None),
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL_NAME}", None),
    ("POST", "/tokenize", {"prompt": "Hi"}),
    ("POST", "/detokenize", {"tokens": [1]}),
    ("GET", "/version", None),
    ("GET", "/status", None),
    ("GET", "/no/such/route", None),
]
MESSAGES = {"model": MODEL_NAME, "max_tokens": 4, "messages": USER}


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer kvr-000000000000-nope"}])
async def test_every_route_wants_a_key_in_openai_shape(
    client: httpx.AsyncClient,
    fake: FakeBackend,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
) -> None:
    response = await client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"].startswith("Bearer")
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == (None if not headers else "invalid_api_key")
    assert set(error) == {"message", "type", "param", "code"}
    assert "kvr-000000000000-nope" not in response.text
    assert fake.seen == []


@pytest.mark.parametrize("headers", [{}, {"x-api-key": "kvr-000000000000-nope"}])
async def test_messages_wants_a_key_in_anthropic_shape(
    client: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    response = await client.post("/v1/messages", json=MESSAGES, headers=headers)
    assert response.status_code == 401
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"
    assert body["request_id"] == response.headers["request-id"] == response.headers["x-request-id"]


async def test_probes_and_metrics_stay_open(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/ready")).status_code == 200
    assert (await client.get("/metrics")).status_code == 200


async def test_bearer_and_x_api_key_both_authenticate(
    client: httpx.AsyncClient, keys: dict[str, str], fake: FakeBackend
) -> None:
    bearer = await client.post(
        "/v1/chat/completions", json=CHAT, headers={"authorization": f"Bearer {keys['acme']}"}
    )
    assert bearer.status_code == 200, bearer.text
    api_key = await client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": keys["acme"]})
    assert api_key.status_code == 200, api_key.text
    both = {"authorization": f"bearer {keys['acme']}", "x-api-key": keys["acme"]}
    assert (await client.post("/v1/messages", json=MESSAGES, headers=both)).status_code == 200
    mixed = {"authorization": f"Bearer {keys['acme']}", "x-api-key": keys["beta"]}
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=mixed)).status_code == 401
    assert (await client.get("/v1/models", headers={"x-api-key": keys["beta"]})).status_code == 200
    assert (
        await client.post("/tokenize", json={"prompt": "Hi"}, headers={"x-api-key": keys["beta"]})
    ).status_code == 200
    assert len(fake.seen) == 3


async def test_an_oversize_body_without_a_key_is_refused_as_unauthenticated(
    client: httpx.AsyncClient,
) -> None:
    response = await client.post("/v1/completions", content=b"x" * (5 * 1024 * 1024))
    assert response.status_code == 401


async def test_a_key_added_or_revoked_applies_without_a_restart(
    client: httpx.AsyncClient, app: FastAPI, keys_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = app.state.authenticator.store
    clock = Clock()
    monkeypatch.setattr(store, "_clock", clock)
    key_id, key = add_key(keys_path, "gamma")
    clock.now += 1.5
    assert (await client.get("/v1/models", headers={"x-api-key": key})).status_code == 200
    remove_key(keys_path, key_id)
    clock.now += 1.5
    assert (await client.get("/v1/models", headers={"x-api-key": key})).status_code == 401


async def test_stored_responses_belong_to_the_tenant(client: httpx.AsyncClient, keys: dict[str, str]) -> None:
    acme, beta = {"x-api-key": keys["acme"]}, {"x-api-key": keys["beta"]}
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 4}
    created = await client.post("/v1/responses", json=body, headers=acme)
    assert created.status_code == 200, created.text
    response_id = created.json()["id"]
    assert (await client.get(f"/v1/responses/{response_id}", headers=acme)).status_code == 200
    assert (await client.get(f"/v1/responses/{response_id}", headers=beta)).status_code == 404
    follow_up = {**body, "previous_response_id": response_id}
    assert (await client.post("/v1/responses", json=follow_up, headers=beta)).status_code == 404
    assert (await client.delete(f"/v1/responses/{response_id}", headers=beta)).status_code == 404
    assert (await client.post("/v1/responses", json=follow_up, headers=acme)).status_code == 200


async def test_a_24h_prompt_cache_retention_needs_a_key_allowed_it(
    client: httpx.AsyncClient, keys_path: Path, keys: dict[str, str], fake: FakeBackend
) -> None:
    """`prompt_cache_retention: "24h"` is a 400 naming the param and the fix for a key without the
    permission, on Chat Completions and Responses alike, and reaches no backend; a key made with it (the
    keys file's cache_retention_24h, as `kvrelay keys add --cache-retention-24h` writes) is served."""
    key_id, allowed = new_key()
    records = read_keys_file(keys_path)
    record = KeyRecord(key_id=key_id, tenant="acme", sha256=key_digest(allowed), cache_retention_24h=True)
    write_keys_file(keys_path, [*records, record])
    bodies = {
        "/v1/chat/completions": {**CHAT, "prompt_cache_retention": "24h"},
        "/v1/responses": {
            "model": MODEL_NAME,
            "input": "Hi",
            "max_output_tokens": 4,
            "prompt_cache_retention": "24h",
        },
    }
    for path, body in bodies.items():
        refused = await client.post(path, json=body, headers={"authorization": f"Bearer {keys['acme']}"})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "prompt_cache_retention" and "--cache-retention-24h" in error["message"]
        assert not fake.seen
        in_memory = {**body, "prompt_cache_retention": "in_memory"}
        served = await client.post(path, json=in_memory, headers={"authorization": f"Bearer {keys['acme']}"})
        assert served.status_code == 200, served.text
        served = await client.post(path, json=body, headers={"authorization": f"Bearer {allowed}"})
        assert served.status_code == 200, served.text
        fake.seen.clear()


async def test_the_audit_line_names_key_and_tenant_and_holds_no_text(
    client: httpx.AsyncClient, keys: dict[str, str], keys_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_ids = {r.tenant: r.key_id for r in read_keys_file(keys_path)}
    with caplog.at_level(logging.DEBUG):
        ok = await client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": keys["acme"]})
        refused = await client.post("/v1/chat/completions", json=CHAT)
        streamed = await client.post(
            "/v1/messages", json={**MESSAGES, "stream": True}, headers={"x-api-key": keys["beta"]}
        )
    assert (ok.status_code, refused.status_code, streamed.status_code) == (200, 401, 200)
    lines = [r for r in caplog.records if r.name == "kvrelay.access"]
    assert len(lines) == 3
    first, second, third = (r.__dict__ for r in lines)
    assert (first["key_id"], first["tenant"], first["route"], first["status"]) == (
        key_ids["acme"],
        "acme",
        "/v1/chat/completions",
        200,
    )
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] > 0 and first["e2e_ms"] > 0
    assert (second["key_id"], second["tenant"], second["status"]) == (None, None, 401)
    assert (third["key_id"], third["tenant"]) == (key_ids["beta"], "beta")
    assert third["protocol"] == "anthropic.messages"
    for record in caplog.records:  # every logger, every level
        text = json.dumps({k: str(v) for k, v in record.__dict__.items()}) + record.getMessage()
        assert CANARY not in text and "Hello world" not in text
        assert keys["acme"] not in text and keys["beta"] not in text


async def test_prefix_cache_hits_are_counted_per_tenant(
    client: httpx.AsyncClient, keys: dict[str, str], fake: FakeBackend
) -> None:
    for tenant in ("acme", "acme", "beta"):
        response = await client.post("/v1/chat/completions", json=CHAT, headers={"x-api-key": keys[tenant]})
        assert response.status_code == 200
    prompt_tokens = len(fake.seen[0].prompt_token_ids)
    await client.get("/v1/models")  # a refusal is counted apart
    text = (await client.get("/metrics")).text
    assert f'kvrelay_prefix_cache_query_tokens_total{{tenant="acme"}} {2 * prompt_tokens}.0' in text
    assert 'kvrelay_prefix_cache_hit_tokens_total{tenant="acme"} 32.0' in text
    assert 'kvrelay_prefix_cache_hit_tokens_total{tenant="beta"} 16.0' in text
    assert 'kvrelay_auth_failures_total{reason="missing"} 1.0' in text


async def test_the_cache_salt_is_the_authenticated_tenants_whatever_the_request_says(
    client: httpx.AsyncClient, keys: dict[str, str], fake: FakeBackend
) -> None:
    for tenant in ("acme", "beta"):
        headers = {"x-api-key": keys[tenant], "x-session-id": "shared", "x-kvrelay-tenant": "acme"}
        body = {**CHAT, "user": "acme", "prompt_cache_key": "acme", "metadata": {"tenant": "acme"}}
        response = await client.post("/v1/chat/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
    assert [seen.cache_salt for seen in fake.seen] == [cache_salt("acme"), cache_salt("beta")]


async def test_open_mode_serves_everyone_as_default(
    tokenizer: Tokenizer, fake: FakeBackend, identity: CodecIdentity, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app(tokenizer, fake, identity)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://codec") as client:
        with caplog.at_level(logging.INFO, logger="kvrelay.access"):
            response = await client.post("/v1/chat/completions", json=CHAT)
        text = (await client.get("/metrics")).text
    assert response.status_code == 200
    line = next(r for r in caplog.records if r.name == "kvrelay.access").__dict__
    assert (line["tenant"], line["key_id"]) == (DEFAULT_TENANT, None)
    assert fake.seen[0].cache_salt == cache_salt(DEFAULT_TENANT)
    assert 'kvrelay_prefix_cache_hit_tokens_total{tenant="default"} 16.0' in text


# ---- the official SDKs see their own authentication errors ----------------------------------------------


@pytest.fixture
def base_url(app: FastAPI) -> Iterator[str]:
    with serve_in_thread(app) as url:
        yield url


def test_the_sdks_raise_authentication_errors(base_url: str, keys: dict[str, str]) -> None:
    def openai_client(key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{base_url}/v1", api_key=key, max_retries=0, http_client=httpx2.Client(timeout=30)
        )

    def anthropic_client(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=base_url, api_key=key, max_retries=0, http_client=httpx2.Client(timeout=30)
        )

    with pytest.raises(openai.AuthenticationError) as openai_error:
        openai_client("kvr-000000000000-wrong").models.list()
    assert openai_error.value.code == "invalid_api_key"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic_client("kvr-000000000000-wrong").messages.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert [m.id for m in openai_client(keys["acme"]).models.list()] == [MODEL_NAME]
    message = anthropic_client(keys["beta"]).messages.create(
        model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
    )
    assert message.content


# ---- the public gRPC API ----------------------------------------------------------------------------------


@pytest.fixture
async def grpc_server(
    tokenizer: Tokenizer, identity: CodecIdentity, fake: FakeBackend, keys_path: Path, keys: dict[str, str]
) -> AsyncIterator[tuple[PublicGrpcServer, CodecState]]:
    config = KvrelayConfig(auth=AuthConfig(keys_file=str(keys_path)))
    state = CodecState.build(fake, tokenizer, config, identity)
    async with PublicGrpcServer("127.0.0.1", 0, grace_s=5.0).serving(state) as running:
        yield running, state


GRPC_CHAT = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content=f"Count. {CANARY}")])


async def test_grpc_wants_a_key_but_health_stays_open(
    grpc_server: tuple[PublicGrpcServer, CodecState],
    keys: dict[str, str],
    fake: FakeBackend,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, state = grpc_server
    async with grpc.aio.insecure_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        await health.Check(health_pb2.HealthCheckRequest(service=""))  # no key: still answers
        stub = public_pb2_grpc.InferenceStub(channel)
        for metadata in ((), (("authorization", "Bearer kvr-000000000000-nope"),)):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                [_ async for _ in stub.Chat(GRPC_CHAT, metadata=metadata)]
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with caplog.at_level(logging.INFO, logger="kvrelay.access"):
            for metadata in ((("authorization", f"Bearer {keys['acme']}"),), (("x-api-key", keys["beta"]),)):
                replies = [r async for r in stub.Chat(GRPC_CHAT, metadata=metadata)]
                assert "".join(r.text for r in replies) == "Hello world"
    lines = [r.__dict__ for r in caplog.records if r.name == "kvrelay.access"]
    assert [(line["tenant"], line["status"]) for line in lines] == [("acme", 200), ("beta", 200)]
    assert [seen.cache_salt for seen in fake.seen] == [cache_salt("acme"), cache_salt("beta")]
    text = state.metrics.render()[0].decode()
    assert 'kvrelay_prefix_cache_hit_tokens_total{tenant="acme"} 16.0' in text
    assert 'kvrelay_auth_failures_total{reason="invalid"} 1.0' in text


def test_rpc_tenant_outside_a_call_is_open_mode() -> None:
    assert rpc_tenant().tenant_id == DEFAULT_TENANT


# ---- the internal token reloads from its file -------------------------------------------------------------


def test_the_internal_token_rotates_from_its_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first-token-0123456789\n")
    tokens = TokenSource.from_env({"KVRELAY_INTERNAL_TOKEN_FILE": str(path)})
    assert tokens.current() == "first-token-0123456789"
    assert tokens.metadata("r1") == (
        ("authorization", "Bearer first-token-0123456789"),
        ("x-request-id", "r1"),
    )
    path.write_text("second-token-0123456789\n")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert tokens.current() == "second-token-0123456789"


async def test_the_internal_interceptor_follows_the_rotated_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first-token-0123456789")
    interceptor = InternalTokenInterceptor(TokenSource(path=path))
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)

    async def continuation(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        return handler

    class Details(grpc.HandlerCallDetails):
        def __init__(self, token: str) -> None:
            self.method = "/kvrelay.v1.Worker/Info"
            self.invocation_metadata = (("authorization", f"Bearer {token}"),)

    assert await interceptor.intercept_service(continuation, Details("first-token-0123456789")) is handler
    path.write_text("second-token-0123456789")
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert await interceptor.intercept_service(continuation, Details("first-token-0123456789")) is not handler
    assert await interceptor.intercept_service(continuation, Details("second-token-0123456789")) is handler
