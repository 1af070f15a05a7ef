"""Bad input gets a clean 4xx in OpenAI's error shape, naming the param, and never reaches the backend."""

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
MAX_CONTEXT = 128
USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL_NAME, "messages": USER}
TEXT = {"model": MODEL_NAME, "prompt": "Hello"}
MISSING = object()


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


def message(**fields: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi", **fields}]


# (field, value, expected param, expected code)
CHAT_CASES: list[tuple[str, Any, str, str | None]] = [
    ("messages", MISSING, "messages", None),
    ("messages", [], "messages", None),
    ("messages", "hi", "messages", None),
    ("messages", message(role="wizard"), "messages[0].role", None),
    # a tool result for a call no assistant message made; an assistant call without its function
    ("messages", message(role="tool", tool_call_id="call_1"), "messages[0].tool_call_id", None),
    (
        "messages",
        [{"role": "assistant", "tool_calls": [{"id": "c"}]}],
        "messages[0].tool_calls[0].function",
        None,
    ),
    ("messages", [{"role": "assistant", "content": None}], "messages[0].content", None),
    ("messages", message(content=7), "messages[0].content", None),
    ("messages", message(content=[{"type": "video", "url": "x"}]), "messages[0].content[0].type", None),
    (
        "messages",
        message(content=[{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
        "messages[0].content[0]",
        "unsupported_parameter",
    ),
    (
        "messages",
        message(content=[{"type": "input_audio"}]),
        "messages[0].content[0]",
        "unsupported_parameter",
    ),
    ("messages", message(content=[{"type": "text"}]), "messages[0].content[0].text", None),
    ("messages", message(extra_field=1), "messages[0].extra_field", "unknown_parameter"),
    ("model", MISSING, "model", None),
    ("model", 5, "model", None),
    ("temperature", 2.5, "temperature", None),
    ("temperature", "hot", "temperature", None),
    ("top_p", 0, "top_p", None),
    ("top_p", 1.5, "top_p", None),
    ("prompt_cache_retention", "forever", "prompt_cache_retention", None),
    ("prompt_cache_retention", "1h", "prompt_cache_retention", None),
    ("prompt_cache_key", "k" * 65, "prompt_cache_key", None),
    ("n", 0, "n", None),
    ("n", 17, "n", None),
    ("n", 1.5, "n", None),
    ("logprobs", "yes", "logprobs", None),
    ("top_logprobs", 3, "top_logprobs", None),  # without logprobs: true
    ("presence_penalty", 3, "presence_penalty", None),
    ("frequency_penalty", -2.5, "frequency_penalty", None),
    ("stop", ["a", "b", "c", "d", "e"], "stop", None),
    ("stop", "", "stop", None),
    ("stop", 5, "stop", None),
    ("max_tokens", 0, "max_tokens", None),
    ("max_tokens", 65, "max_tokens", None),  # over limits.max_output_tokens: refused, not clamped
    ("max_completion_tokens", 0, "max_completion_tokens", None),
    ("seed", "x", "seed", None),
    ("stream", "yes", "stream", None),
    ("stream_options", {"include_usage": True}, "stream_options", None),  # without stream
    # tools whose parameters are no object schema; a tool_choice naming a tool that is not offered
    (
        "tools",
        [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
        "tools[0]",
        None,
    ),
    ("tool_choice", {"type": "function", "function": {"name": "f"}}, "tool_choice", None),
    ("functions", [{"name": "f"}], "functions", "unsupported_parameter"),
    ("function_call", "auto", "function_call", "unsupported_parameter"),
    ("audio", {"voice": "alloy", "format": "wav"}, "audio", "unsupported_parameter"),
    ("modalities", ["text", "audio"], "modalities", "unsupported_parameter"),
    ("prediction", {"type": "content", "content": "x"}, "prediction", "unsupported_parameter"),
    ("web_search_options", {}, "web_search_options", "unsupported_parameter"),
    (
        "response_format",
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        "response_format",
        None,
    ),
    ("logit_bias", {"50256": -100}, "logit_bias", "unsupported_parameter"),
    ("frobnicate", True, "frobnicate", "unknown_parameter"),
    ("min_tokens", 70, "min_tokens", None),  # above the default max_tokens
    ("stop_token_ids", [10**9], "stop_token_ids", None),
    ("top_k", -2, "top_k", None),
]

TEXT_CASES: list[tuple[str, Any, str, str | None]] = [
    ("prompt", MISSING, "prompt", None),
    ("prompt", "", "prompt", None),
    ("prompt", [], "prompt", None),
    ("prompt", ["one", "two"], "prompt", "unsupported_parameter"),
    ("prompt", [[1, 2], [3]], "prompt", "unsupported_parameter"),
    ("prompt", [10**9], "prompt", None),
    ("prompt", 12, "prompt", None),
    ("echo", True, "echo", "unsupported_parameter"),
    ("suffix", "tail", "suffix", "unsupported_parameter"),
    ("best_of", 2, "best_of", "unsupported_parameter"),
    ("logprobs", 21, "logprobs", None),
    ("logprobs", True, "logprobs", None),
    ("logit_bias", {"1": 2}, "logit_bias", "unsupported_parameter"),
    ("max_completion_tokens", 5, "max_completion_tokens", "unknown_parameter"),
    ("use_beam_search", True, "use_beam_search", "unsupported_parameter"),
    ("decoder_prompt", "Hi", "decoder_prompt", None),  # the fake serves a decoder-only model
    ("decoder_prompt", [1, 2], "decoder_prompt", None),
]


def assert_openai_error(response: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["message"]
    assert error["param"] == param
    assert error["code"] == code


@pytest.mark.parametrize(("name", "value", "param", "code"), CHAT_CASES)
async def test_bad_chat_field_is_400_naming_param(
    client: httpx.AsyncClient, fake: FakeBackend, name: str, value: Any, param: str, code: str | None
) -> None:
    for stream in (False, True):
        body = with_field({**CHAT, "stream": stream} if name != "stream_options" else CHAT, name, value)
        response = await client.post("/v1/chat/completions", json=body)
        assert_openai_error(response, 400, param, code)
    assert fake.seen == []


@pytest.mark.parametrize(("name", "value", "param", "code"), TEXT_CASES)
async def test_bad_completion_field_is_400_naming_param(
    client: httpx.AsyncClient, fake: FakeBackend, name: str, value: Any, param: str, code: str | None
) -> None:
    response = await client.post("/v1/completions", json=with_field(TEXT, name, value))
    assert_openai_error(response, 400, param, code)
    assert fake.seen == []


async def test_unknown_model_is_404(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        response = await client.post(path, json={**body, "model": "nope"})
        assert_openai_error(response, 404, "model", "model_not_found")
    assert fake.seen == []


@pytest.mark.parametrize(
    ("content", "content_type", "status"),
    [
        (b"{not json", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (b'"text"', "application/json", 400),
        (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "application/json", 400),
        (b'{"temperature": NaN}', "application/json", 400),
        (b"model=m", "application/x-www-form-urlencoded", 415),
        (b"{}", "text/plain", 415),
    ],
)
async def test_malformed_body_is_rejected_in_openai_shape(
    client: httpx.AsyncClient, fake: FakeBackend, content: bytes, content_type: str, status: int
) -> None:
    response = await client.post(
        "/v1/chat/completions", content=content, headers={"content-type": content_type}
    )
    assert_openai_error(response, status, None, None)
    assert fake.seen == []


async def test_oversize_body_with_content_length_is_413(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * MAX_BODY_BYTES}]}
    response = await client.post("/v1/chat/completions", json=body)
    assert_openai_error(response, 413, None, None)
    assert fake.seen == []


async def test_oversize_chunked_body_is_413_before_it_is_all_read(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    num_sent = 0

    async def chunks() -> AsyncIterator[bytes]:
        nonlocal num_sent
        yield b'{"model": "smollm2-test", "messages": [{"role": "user", "content": "'
        for _ in range(64):
            num_sent += 1
            yield b"x" * 1024
        yield b'"}]}'

    response = await client.post(
        "/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"}
    )
    assert_openai_error(response, 413, None, None)
    assert num_sent < 64  # refused while streaming in, not after buffering it all
    assert fake.seen == []


async def test_prompt_over_max_input_tokens_is_context_length_exceeded(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    response = await client.post("/v1/completions", json={**TEXT, "prompt": [19556] * 101})
    assert_openai_error(response, 400, "prompt", "context_length_exceeded")
    assert fake.seen == []


async def test_prompt_plus_max_tokens_over_context_is_context_length_exceeded(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    response = await client.post("/v1/completions", json={**TEXT, "prompt": [19556] * 100, "max_tokens": 64})
    assert response.json()["error"]["message"].endswith(f"the model's context of {MAX_CONTEXT} tokens")
    assert_openai_error(response, 400, "max_tokens", "context_length_exceeded")
    response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 64})  # 31 + 64 fits
    assert response.status_code == 200
    assert fake.seen[0].sampling.max_tokens == 64


async def test_absent_max_tokens_is_the_default_capped_by_the_context(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> None:
    fake.max_model_len = 105
    config = make_config(max_input_tokens=100, max_output_tokens=64, default_max_output_tokens=16)
    app = make_app(tokenizer, fake, identity_for(model_dir), config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        for num_prompt_tokens in (10, 100):
            response = await client.post(
                "/v1/completions", json={**TEXT, "prompt": [19556] * num_prompt_tokens}
            )
            assert response.status_code == 200
    assert [request.sampling.max_tokens for request in fake.seen] == [16, 5]


async def test_accept_and_ignore_fields_are_accepted(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    ignored = {
        "user": "u",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "reasoning_effort": "low",
        "verbosity": "low",
        "parallel_tool_calls": True,
        "tool_choice": "none",
        "tools": [],
        "response_format": {"type": "text"},
        "logit_bias": {},
        "modalities": ["text"],
        "ignore_eos": True,
        "top_k": -1,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "min_tokens": 1,
        "stop_token_ids": [17],
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
    }
    response = await client.post("/v1/chat/completions", json={**CHAT, **ignored})
    assert response.status_code == 200, response.text
    sampling = fake.seen[0].sampling
    assert (sampling.ignore_eos, sampling.top_k, sampling.min_p, sampling.min_tokens) == (True, 0, 0.1, 1)
    assert sampling.stop_token_ids == (17,)


async def test_unknown_route_and_wrong_method_use_openai_shape(client: httpx.AsyncClient) -> None:
    response = await client.post("/v1/nothing", json={})
    assert response.status_code == 404 and response.json()["error"]["type"] == "invalid_request_error"
    response = await client.get("/v1/chat/completions")
    assert response.status_code == 405 and set(response.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }
