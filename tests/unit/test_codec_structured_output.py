"""Structured output at the codec (issue 23): each protocol's field becomes one grammar spec on the request
the backend sees; a constraint that cannot compile, or two at once, is a 400 in the protocol's own shape
that no backend sees. The engine's half (masks) is tested in the engine's and the stack's tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.codec.text.tokenizer import Tokenizer
from services.common.grammar import GrammarKind, GrammarSpec
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

pytestmark = pytest.mark.model

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "Describe a person as JSON."}]
CHAT = {"model": MODEL_NAME, "messages": USER, "max_tokens": 8}
ROUTES: dict[str, tuple[str, dict[str, Any], GrammarSpec]] = {
    "chat json_schema": (
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
            },
        },
        GrammarSpec.json_schema(SCHEMA, strict=True),
    ),
    "chat json_object": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_object"}},
        GrammarSpec(GrammarKind.JSON_OBJECT),
    ),
    "chat structured_outputs regex": (
        "/v1/chat/completions",
        {**CHAT, "structured_outputs": {"regex": "[0-9]{3}"}},
        GrammarSpec(GrammarKind.REGEX, "[0-9]{3}"),
    ),
    "completions guided_choice": (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "Yes or no?", "max_tokens": 4, "guided_choice": ["yes", "no"]},
        GrammarSpec.choice(["yes", "no"]),
    ),
    "completions guided_grammar": (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "Say", "max_tokens": 4, "guided_grammar": 'start: "a" | "b"'},
        GrammarSpec(GrammarKind.LARK, 'start: "a" | "b"'),
    ),
    "responses text.format": (
        "/v1/responses",
        {
            "model": MODEL_NAME,
            "input": "Describe a person.",
            "max_output_tokens": 8,
            "text": {"format": {"type": "json_schema", "name": "p", "schema": SCHEMA, "strict": True}},
        },
        GrammarSpec.json_schema(SCHEMA, strict=True),
    ),
    "messages output_config.format": (
        "/v1/messages",
        {**CHAT, "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}},
        GrammarSpec.json_schema(SCHEMA, strict=True),
    ),
}
BAD: dict[str, tuple[str, dict[str, Any], str]] = {
    "regex syntax": (
        "/v1/chat/completions",
        {**CHAT, "structured_outputs": {"regex": "a(b"}},
        "structured_outputs.regex",
    ),
    "lark syntax": (
        "/v1/completions",
        {"model": MODEL_NAME, "prompt": "x", "guided_grammar": "start: nowhere"},
        "guided_grammar",
    ),
    "schema not a schema": (
        "/v1/chat/completions",
        {
            **CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "nonsense"}},
            },
        },
        "response_format",
    ),
    "strict unsupported format": (
        "/v1/responses",
        {
            "model": MODEL_NAME,
            "input": "x",
            "text": {
                "format": {
                    "type": "json_schema",
                    "name": "p",
                    "strict": True,
                    "schema": {"type": "string", "format": "shoe-size"},
                }
            },
        },
        "text.format",
    ),
    "messages schema": (
        "/v1/messages",
        {
            **CHAT,
            "output_config": {
                "format": {"type": "json_schema", "schema": {"type": "string", "format": "shoe-size"}}
            },
        },
        "output_config.format",
    ),
    "two constraints": (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
        "guided_regex",
    ),
}


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path, tokenizer: Tokenizer) -> FakeBackend:
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    backend.script = scripted([tokenizer.encode('{"name":"Ann","age":30}')])
    return backend


@pytest.fixture
async def client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(tokenizer, fake, identity_for(model_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_each_protocol_sends_its_constraint_as_one_grammar_spec(
    client: httpx.AsyncClient, fake: FakeBackend, route: str
) -> None:
    path, body, expected = ROUTES[route]
    response = await client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert fake.seen[-1].sampling.grammar == expected


async def test_responses_echo_the_format_asked_for(client: httpx.AsyncClient) -> None:
    path, body, _ = ROUTES["responses text.format"]
    response = (await client.post(path, json=body)).json()
    # Echoed with every key the Open Responses schema requires (`description` null when not asked).
    assert response["text"]["format"] == {**body["text"]["format"], "description": None}
    assert json.loads(response["output"][0]["content"][0]["text"]) == {"name": "Ann", "age": 30}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_a_constraint_that_cannot_compile_is_a_400_no_backend_sees(
    client: httpx.AsyncClient, fake: FakeBackend, case: str
) -> None:
    path, body, param = BAD[case]
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if path == "/v1/messages":
        assert response.json()["type"] == "error" and error["type"] == "invalid_request_error"
    else:
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert fake.seen == []


async def test_a_stop_string_wins_over_the_constraint(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    """The constraint shapes the tokens; a stop string still ends the text where it matches, inside the
    value (docs/protocols.md, "Structured output")."""
    body = {**CHAT, "response_format": {"type": "json_object"}, "stop": [","]}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == '{"name":"Ann"'
    assert fake.seen[-1].sampling.grammar == GrammarSpec(GrammarKind.JSON_OBJECT)
