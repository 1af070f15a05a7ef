"""Bodies an attacker sends with raw HTTP (issue 22's list): each is a 4xx in its protocol's own shape
before the backend sees anything, and the codec keeps serving. Raw bytes, not an SDK: the SDKs would not
send most of these."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.codec.protocols.request_body import MAX_JSON_DEPTH
from services.codec.text.stop_strings import MAX_STOP_STRING_CHARS
from services.codec.text.tokenizer import Tokenizer
from services.common.sampling import MAX_STOP_TOKEN_IDS
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, make_config, scripted

pytestmark = pytest.mark.model

USER = [{"role": "user", "content": "hi"}]
ROUTES = {
    "chat": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": USER}),
    "completions": ("/v1/completions", {"model": MODEL_NAME, "prompt": "Hello"}),
    "responses": ("/v1/responses", {"model": MODEL_NAME, "input": "hi"}),
    "messages": ("/v1/messages", {"model": MODEL_NAME, "max_tokens": 8, "messages": USER}),
}
DEEP = 100_000


@pytest.fixture
def fake(model_dir: Path) -> FakeBackend:
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    backend.script = scripted([[19556]])
    return backend


@pytest.fixture
async def client(model_dir: Path, fake: FakeBackend) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(
        Tokenizer.from_dir(model_dir), fake, identity_for(model_dir), make_config(max_body_bytes=4 << 20)
    )
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


async def post_raw(client: httpx.AsyncClient, path: str, raw: str) -> httpx.Response:
    return await client.post(path, content=raw.encode(), headers={"content-type": "application/json"})


def assert_refused(route: str, response: httpx.Response, status: int = 400) -> dict[str, Any]:
    """The protocol's own error shape, with the given status; returns the error object."""
    assert response.status_code == status, response.text
    body = response.json()
    if route == "messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        return dict(body["error"])
    assert body["error"]["type"] == "invalid_request_error"
    return dict(body["error"])


async def assert_still_serving(client: httpx.AsyncClient, fake: FakeBackend, route: str) -> None:
    path, body = ROUTES[route]
    assert not fake.seen, "a hostile body reached the backend"
    assert (await client.post(path, json=body)).status_code == 200
    assert len(fake.seen) == 1


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_a_body_nested_100000_deep_is_a_400(
    client: httpx.AsyncClient, fake: FakeBackend, route: str
) -> None:
    path, _ = ROUTES[route]
    raw = '{"model": "' + MODEL_NAME + '", "metadata": ' + "[" * DEEP + "]" * DEEP + "}"
    error = assert_refused(route, await post_raw(client, path, raw))
    assert f"deeper than {MAX_JSON_DEPTH}" in error["message"]
    await assert_still_serving(client, fake, route)


async def test_nesting_up_to_the_limit_is_parsed(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    """At the limit the body reaches the schema (which refuses the unknown field by name)."""
    path, _ = ROUTES["chat"]
    raw = (
        '{"model": "x", "messages": [], "extra": '
        + "[" * (MAX_JSON_DEPTH - 1)
        + "]" * (MAX_JSON_DEPTH - 1)
        + "}"
    )
    error = assert_refused("chat", await post_raw(client, path, raw))
    assert "deeper than" not in error["message"]


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_a_lone_surrogate_is_a_400_naming_where_it_is(
    client: httpx.AsyncClient, fake: FakeBackend, route: str
) -> None:
    path, _ = ROUTES[route]
    field = {"chat": "messages", "completions": "prompt", "responses": "input", "messages": "messages"}[route]
    value = (
        '"\\ud800"' if route in ("completions", "responses") else '[{"role": "user", "content": "a\\ud800b"}]'
    )
    raw = '{"model": "' + MODEL_NAME + f'", "max_tokens": 8, "{field}": {value}' + "}"
    error = assert_refused(route, await post_raw(client, path, raw))
    assert "lone UTF-16 surrogate" in error["message"] and field in error["message"]
    await assert_still_serving(client, fake, route)


async def test_a_surrogate_pair_is_text(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    path, _ = ROUTES["chat"]
    raw = '{"model": "' + MODEL_NAME + '", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert (await post_raw(client, path, raw)).status_code == 200


async def test_200000_stop_token_ids_are_a_400(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    path, body = ROUTES["chat"]
    response = await client.post(
        path, json={**body, "stop_token_ids": [2] * 200_000}
    )  # each in the vocabulary
    error = assert_refused("chat", response)
    assert error["param"] == "stop_token_ids" and f"at most {MAX_STOP_TOKEN_IDS}" in error["message"]
    await assert_still_serving(client, fake, "chat")


async def test_stop_token_ids_are_deduplicated(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    path, body = ROUTES["completions"]
    ids = [7, 9, 7, 7, 9] * (MAX_STOP_TOKEN_IDS // 5)
    assert (await client.post(path, json={**body, "stop_token_ids": ids})).status_code == 200
    assert fake.seen[0].sampling.stop_token_ids == (7, 9)


@pytest.mark.parametrize("route", ["chat", "completions", "messages"])
async def test_a_100000_character_stop_string_is_a_400(
    client: httpx.AsyncClient, fake: FakeBackend, route: str
) -> None:
    path, body = ROUTES[route]
    name = "stop_sequences" if route == "messages" else "stop"
    error = assert_refused(route, await client.post(path, json={**body, name: ["x" * 100_000]}))
    assert name in error["message"] or error.get("param", "").startswith(name)
    at_limit = await client.post(path, json={**body, name: ["y" * MAX_STOP_STRING_CHARS]})
    assert at_limit.status_code == 200
