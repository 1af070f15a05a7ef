"""Bad input on /v1/messages* gets a clean 4xx in Anthropic's error shape and never reaches the backend;
fields Anthropic defines that we accept and ignore really are accepted."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, make_config, scripted

pytestmark = pytest.mark.model

MAX_BODY_BYTES = 4096
HI = [{"role": "user", "content": "hi"}]
MESSAGES = {"model": MODEL_NAME, "max_tokens": 16, "messages": HI}
COUNT = {"model": MODEL_NAME, "messages": HI}
MISSING = object()


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path) -> FakeBackend:
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint, max_model_len=128)
    backend.script = scripted([[19556]])
    return backend


@pytest.fixture
async def client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> AsyncIterator[httpx.AsyncClient]:
    config = make_config(
        max_input_tokens=100,
        max_output_tokens=64,
        default_max_output_tokens=16,
        max_body_bytes=MAX_BODY_BYTES,
    )
    app = make_app(tokenizer, fake, identity_for(model_dir), config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


def with_field(base: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    body = dict(base)
    if value is MISSING:
        body.pop(name, None)
    else:
        body[name] = value
    return body


def user(content: Any, **fields: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content, **fields}]


THOUGHT = {"type": "thinking", "thinking": "x", "signature": "s"}


def cached_text(text: str, ttl: str | None = None) -> dict[str, Any]:
    control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return {"type": "text", "text": text, "cache_control": control}


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
TOOL = {"name": "f", "input_schema": {"type": "object"}}

# (field, value, a text the error message must contain)
MESSAGES_CASES: list[tuple[str, Any, str]] = [
    ("messages", MISSING, "messages"),
    ("messages", [], "messages"),
    ("messages", "hi", "messages"),
    ("messages", [{"role": "system", "content": "x"}], "messages[0].role"),
    ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
    ("messages", user(7), "messages[0].content"),
    ("messages", user("hi", name="bob"), "messages[0].name"),
    ("messages", user([{"type": "video", "url": "x"}]), "messages[0].content[0]"),
    ("messages", user([{"type": "text"}]), "messages[0].content[0].text"),
    ("messages", user([{"type": "text", "text": "a", "colour": "red"}]), "messages[0].content[0].colour"),
    ("messages", user([IMAGE]), "image content blocks are not supported"),
    ("messages", user([{"type": "document", "source": {}}]), "messages[0].content[0]"),
    ("messages", user([{"type": "tool_result", "tool_use_id": "t", "content": "1"}]), "tool_result"),
    (
        "messages",
        [*HI, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}],
        "messages[1].content[0]",
    ),
    (
        "messages",
        user([{"type": "thinking", "thinking": "x"}]),
        "thinking blocks cannot be in a user message",
    ),
    ("messages", [*HI, {"role": "assistant", "content": "Sure, "}], "trailing whitespace"),
    ("messages", user([cached_text(str(i)) for i in range(5)]), "at most 4 blocks may carry cache_control"),
    (
        "messages",
        user([cached_text("a"), cached_text("b", "1h")]),
        'ttl "1h" cannot come after one with ttl "5m"',
    ),
    ("messages", user([cached_text("")]), "cache_control cannot be set on an empty text block"),
    (
        "messages",
        [*HI, {"role": "assistant", "content": [{**THOUGHT, "cache_control": {"type": "ephemeral"}}]}, *HI],
        "messages[1].content[0].cache_control",
    ),
    ("model", MISSING, "model"),
    ("model", 5, "model"),
    ("max_tokens", MISSING, "max_tokens"),
    ("max_tokens", 0, "max_tokens"),
    ("max_tokens", "5", "max_tokens"),
    ("max_tokens", 1.5, "max_tokens"),
    ("max_tokens", 65, "max_tokens"),  # over limits.max_output_tokens: refused, not clamped
    ("temperature", 1.5, "temperature"),
    ("temperature", -0.1, "temperature"),
    ("temperature", "hot", "temperature"),
    ("top_p", 0, "top_p"),
    ("top_p", 1.5, "top_p"),
    ("top_k", -1, "top_k"),
    ("stop_sequences", "END", "stop_sequences"),
    ("stop_sequences", [""], "stop_sequences"),
    ("stop_sequences", [5], "stop_sequences"),
    ("stop_sequences", [f"s{i}" for i in range(17)], "stop_sequences"),
    ("stream", "yes", "stream"),
    ("system", 5, "system"),
    ("system", [IMAGE], "system"),
    ("metadata", {"user_id": 5}, "metadata.user_id"),
    ("metadata", {"session": "x"}, "metadata.session"),
    ("tools", [{"name": "f", "input_schema": {"type": "string"}}], "tools[0].input_schema"),
    ("tool_choice", {"type": "tool", "name": "nope"}, "tool_choice"),
    ("thinking", {"type": "enabled", "budget_tokens": 1024}, "thinking"),
    ("thinking", {"type": "enabled", "budget_tokens": 512}, "thinking.budget_tokens"),
    ("container", "container_1", "container"),
    (
        "output_config",
        {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
        "output_config.format",
    ),
    ("service_tier", "priority", "service_tier"),
    ("frobnicate", True, "frobnicate"),
]


def assert_anthropic_error(response: httpx.Response, status: int, error_type: str, text: str = "") -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert set(body) == {"type", "error", "request_id"}
    assert body["type"] == "error"
    assert set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == error_type
    assert text in body["error"]["message"]
    assert body["request_id"] == response.headers["request-id"] == response.headers["x-request-id"]


@pytest.mark.parametrize(("name", "value", "text"), MESSAGES_CASES)
async def test_bad_messages_field_is_400_invalid_request(
    client: httpx.AsyncClient, fake: FakeBackend, name: str, value: Any, text: str
) -> None:
    for stream in (False, True):
        response = await client.post(
            "/v1/messages", json=with_field({**MESSAGES, "stream": stream}, name, value)
        )
        assert_anthropic_error(response, 400, "invalid_request_error", text)
    assert fake.seen == []


@pytest.mark.parametrize(
    ("name", "value", "text"),
    [
        ("max_tokens", 16, "max_tokens"),  # count_tokens takes only what decides the prompt
        ("stream", True, "stream"),
        ("messages", [], "messages"),
        ("messages", user([IMAGE]), "image"),
        ("tools", [{"name": "f", "input_schema": {"type": "string"}}], "tools[0].input_schema"),
        ("thinking", {"type": "enabled", "budget_tokens": 512}, "thinking.budget_tokens"),
    ],
)
async def test_bad_count_tokens_field_is_400(
    client: httpx.AsyncClient, name: str, value: Any, text: str
) -> None:
    response = await client.post("/v1/messages/count_tokens", json=with_field(COUNT, name, value))
    assert_anthropic_error(response, 400, "invalid_request_error", text)


async def test_unknown_model_is_404_not_found(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    for path, body in (("/v1/messages", MESSAGES), ("/v1/messages/count_tokens", COUNT)):
        response = await client.post(path, json={**body, "model": "nope"})
        assert_anthropic_error(response, 404, "not_found_error", "nope")
    assert fake.seen == []


@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b"{not json", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (
            b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "\xff"}]}',
            "application/json",
            400,
        ),
        (b'{"temperature": NaN}', "application/json", 400),
        (b"{}", "text/plain", 415),
    ],
)
async def test_malformed_body_is_rejected_in_anthropic_shape(
    client: httpx.AsyncClient, fake: FakeBackend, content: bytes, content_type: str, status: int
) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = await client.post(path, content=content, headers={"content-type": content_type})
        assert_anthropic_error(response, status, "invalid_request_error")
    assert fake.seen == []


async def test_oversize_body_is_413_request_too_large(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    body = {**MESSAGES, "messages": user("x" * MAX_BODY_BYTES)}
    response = await client.post("/v1/messages", json=body)  # refused from Content-Length
    assert_anthropic_error(response, 413, "request_too_large")

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "smollm2-test", "max_tokens": 1, "messages": [{"role": "user", "content": "'
        for _ in range(8):
            yield b"x" * 1024
        yield b'"}]}'

    response = await client.post(
        "/v1/messages", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_anthropic_error(response, 413, "request_too_large")  # refused while streaming in
    assert fake.seen == []


async def test_prompt_over_the_limits_is_400(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    response = await client.post("/v1/messages", json={**MESSAGES, "messages": user("hello " * 120)})
    assert_anthropic_error(response, 400, "invalid_request_error", "the prompt has")
    response = await client.post(
        "/v1/messages", json={**MESSAGES, "max_tokens": 64, "messages": user("hi " * 50)}
    )
    assert_anthropic_error(response, 400, "invalid_request_error", "context")
    assert fake.seen == []


async def test_unknown_route_and_wrong_method_use_anthropic_shape(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/messages/no_such_route", json={})
    assert_anthropic_error(response, 404, "not_found_error")
    response = await client.get("/v1/messages")
    assert_anthropic_error(response, 405, "invalid_request_error")
    response = await client.post("/v1/chat/completions", json={"model": "nope", "messages": HI})
    assert response.status_code == 404 and set(response.json()) == {"error"}  # OpenAI's shape stays


async def test_backend_down_is_503_overloaded_with_retry_after(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    fake.is_unavailable = True
    response = await client.post("/v1/messages", json=MESSAGES)
    assert_anthropic_error(response, 503, "overloaded_error")
    assert response.headers["retry-after"] == "1"


async def test_accept_and_ignore_fields_and_headers_are_accepted(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    ignored = {
        "metadata": {"user_id": "session-1"},
        "service_tier": "standard_only",
        "cache_control": {"type": "ephemeral", "ttl": "5m"},
        "inference_geo": "us",
        "speed": "standard",
        "diagnostics": {"previous_message_id": "msg_1"},
        "user_profile_id": "p",
        "workspace_id": "w",
        "output_config": {"effort": "low"},
        "thinking": {"type": "disabled"},
        "tool_choice": {"type": "none"},
        "tools": [],
        "container": None,
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "messages": user([{"type": "text", "text": "hi", "citations": None}]),
    }
    headers = [{"x-api-key": "k", "anthropic-version": "2023-06-01"}, {"authorization": "Bearer k"}, {}]
    for header in headers:
        response = await client.post("/v1/messages", json={**MESSAGES, **ignored}, headers=header)
        assert response.status_code == 200, response.text
        count_body = {
            name: value for name, value in ignored.items() if name in ("system", "messages", "tools")
        }
        response = await client.post(
            "/v1/messages/count_tokens", json={**COUNT, **count_body}, headers=header
        )
        assert response.status_code == 200, response.text
        assert response.json() == {"input_tokens": len(fake.seen[-1].prompt_token_ids)}
    assert len(fake.seen) == len(headers)
