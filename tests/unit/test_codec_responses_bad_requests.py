"""Bad input to `/v1/responses` gets a clean 4xx in OpenAI's error shape, naming the param, and never
reaches the backend."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, make_config, scripted

pytestmark = pytest.mark.model

MAX_CONTEXT = 128
BASE = {"model": MODEL_NAME, "input": "hi"}
MISSING = object()
UNSUPPORTED = "unsupported_parameter"


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path) -> FakeBackend:
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint, max_model_len=MAX_CONTEXT)
    backend.script = scripted([[19556]])
    return backend


@pytest.fixture
async def client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> AsyncIterator[httpx.AsyncClient]:
    config = make_config(max_input_tokens=100, max_output_tokens=64, default_max_output_tokens=16)
    app = make_app(tokenizer, fake, identity_for(model_dir), config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


def with_field(name: str, value: Any) -> dict[str, Any]:
    body: dict[str, Any] = dict(BASE)
    if value is MISSING:
        body.pop(name, None)
    else:
        body[name] = value
    return body


def user(content: Any, **fields: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content, **fields}]


def text_part(part_type: str, **fields: Any) -> dict[str, Any]:
    return {"type": part_type, **fields}


# (field, value, expected param, expected code)
CASES: list[tuple[str, Any, str, str | None]] = [
    ("model", MISSING, "model", None),
    ("prompt_cache_retention", "forever", "prompt_cache_retention", None),
    ("prompt_cache_key", "k" * 65, "prompt_cache_key", None),
    ("model", 5, "model", None),
    ("input", MISSING, "input", None),
    ("input", "", "input", None),
    ("input", [], "input", None),
    ("input", 5, "input", None),
    ("input", ["hi"], "input[0]", None),
    ("input", user("hi", role="wizard"), "input[0].role", None),
    ("input", [{"role": "tool", "content": "x"}], "input[0].role", None),
    ("input", [{"type": "banana", "role": "user", "content": "x"}], "input[0].type", None),
    # the output of a call that no earlier item (nor the stored conversation) made
    ("input", [{"type": "function_call_output", "call_id": "c", "output": "x"}], "input[0].call_id", None),
    ("input", user(7), "input[0].content", None),
    ("input", user("hi", name="bob"), "input[0].name", "unknown_parameter"),
    ("input", user([text_part("video")]), "input[0].content[0].type", None),
    (
        "input",
        user([text_part("input_image", image_url="http://x/y.png")]),
        "input[0].content[0]",
        UNSUPPORTED,
    ),
    ("input", user([text_part("input_file", file_id="file_1")]), "input[0].content[0]", UNSUPPORTED),
    ("input", user([text_part("input_text")]), "input[0].content[0].text", None),
    ("input", user([text_part("output_text", text="x")]), "input[0].content[0].type", None),
    (
        "input",
        [{"role": "assistant", "content": [text_part("input_text", text="x")]}],
        "input[0].content[0].type",
        None,
    ),
    ("instructions", 5, "instructions", None),
    ("max_output_tokens", 0, "max_output_tokens", None),
    ("max_output_tokens", "ten", "max_output_tokens", None),
    ("max_output_tokens", 65, "max_output_tokens", None),  # over limits.max_output_tokens
    ("temperature", 2.5, "temperature", None),
    ("temperature", "hot", "temperature", None),
    ("top_p", 0, "top_p", None),
    ("top_p", 1.5, "top_p", None),
    ("stream", "yes", "stream", None),
    ("store", "no", "store", None),
    ("stream_options", {"include_obfuscation": False}, "stream_options", None),  # without stream
    ("previous_response_id", 12, "previous_response_id", None),
    ("metadata", {"k": 1}, "metadata", None),
    ("metadata", {f"k{i}": "v" for i in range(17)}, "metadata", None),
    ("truncation", "auto", "truncation", UNSUPPORTED),
    ("truncation", "sideways", "truncation", None),
    ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format", None),  # no schema
    (
        "text",
        {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}},
        "text.format",
        None,
    ),
    ("text", {"format": {"type": "yaml"}}, "text.format.type", None),
    ("tools", [{"type": "web_search"}], "tools", UNSUPPORTED),
    ("tools", [{"type": "file_search", "vector_store_ids": ["vs_1"]}], "tools", UNSUPPORTED),
    ("tools", [{"type": "code_interpreter", "container": {"type": "auto"}}], "tools", UNSUPPORTED),
    (
        "tools",
        [{"type": "computer_use_preview", "display_width": 1, "display_height": 1}],
        "tools",
        UNSUPPORTED,
    ),
    ("tools", [{"type": "mcp", "server_label": "s", "server_url": "http://x"}], "tools", UNSUPPORTED),
    ("tools", [{"type": "image_generation"}], "tools", UNSUPPORTED),
    # a function tool whose parameters are no object schema
    (
        "tools",
        [{"type": "function", "name": "f", "parameters": {"type": "string"}, "strict": True}],
        "tools[0]",
        None,
    ),
    ("tools", "web_search", "tools", None),
    ("tool_choice", "required", "tool_choice", None),  # forcing a call with no tools offered
    ("background", True, "background", UNSUPPORTED),
    ("conversation", "conv_1", "conversation", UNSUPPORTED),
    ("include", ["reasoning.encrypted_content"], "include", UNSUPPORTED),
    ("prompt", {"id": "pmpt_1"}, "prompt", UNSUPPORTED),
    ("top_logprobs", 2, "top_logprobs", UNSUPPORTED),
    ("top_logprobs", 21, "top_logprobs", None),
    ("service_tier", "gold", "service_tier", None),
    ("frobnicate", True, "frobnicate", "unknown_parameter"),
    ("messages", [{"role": "user", "content": "hi"}], "messages", "unknown_parameter"),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)


@pytest.mark.parametrize(("name", "value", "param", "code"), CASES)
async def test_bad_field_is_400_naming_param(
    client: httpx.AsyncClient, fake: FakeBackend, name: str, value: Any, param: str, code: str | None
) -> None:
    for stream in (False, True) if name != "stream_options" else (False,):
        body = {**with_field(name, value), **({"stream": True} if stream and name != "stream" else {})}
        response = await client.post("/v1/responses", json=body)
        assert_openai_error(response, 400, param, code)
    assert fake.seen == []


async def test_unknown_model_is_404(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    response = await client.post("/v1/responses", json={**BASE, "model": "nope"})
    assert_openai_error(response, 404, "model", "model_not_found")
    assert fake.seen == []


@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b"{not json", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (b'{"model": "m", "input": "\xff\xfe"}', "application/json", 400),
        (b"{}", "text/plain", 415),
    ],
)
async def test_malformed_body_is_rejected_in_openai_shape(
    client: httpx.AsyncClient, fake: FakeBackend, content: bytes, content_type: str, status: int
) -> None:
    response = await client.post("/v1/responses", content=content, headers={"content-type": content_type})
    assert_openai_error(response, status, None, None)
    assert fake.seen == []


async def test_overflowing_the_context_is_400_with_truncation_disabled(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    response = await client.post(
        "/v1/responses", json={**BASE, "input": "hi " * 150, "truncation": "disabled"}
    )
    assert_openai_error(response, 400, "input", "context_length_exceeded")
    response = await client.post("/v1/responses", json={**BASE, "input": "hi " * 60, "max_output_tokens": 64})
    assert_openai_error(response, 400, "max_output_tokens", "context_length_exceeded")
    assert "max_output_tokens" in response.json()["error"]["message"]
    assert fake.seen == []


async def test_streaming_a_stored_response_is_refused(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    created = await client.post("/v1/responses", json=BASE)
    response = await client.get(f"/v1/responses/{created.json()['id']}", params={"stream": "true"})
    assert_openai_error(response, 400, "stream", UNSUPPORTED)


async def test_neutral_values_of_unsupported_fields_are_accepted(client: httpx.AsyncClient) -> None:
    body = {
        **BASE,
        "tools": [],
        "tool_choice": "none",
        "include": [],
        "background": False,
        "truncation": "disabled",
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "reasoning": {"effort": "low"},
        "service_tier": "auto",
        "top_logprobs": 0,
        "parallel_tool_calls": False,
        "prompt_cache_key": "k",
        "safety_identifier": "s",
    }
    response = await client.post("/v1/responses", json=body)
    assert response.status_code == 200, response.text
    echoed = response.json()
    assert (echoed["tool_choice"], echoed["parallel_tool_calls"]) == ("none", False)
    assert (echoed["prompt_cache_key"], echoed["safety_identifier"]) == ("k", "s")
