"""Golden Anthropic Messages SSE transcripts: a fixed fake token stream must give exactly these bytes
(written by hand from the Anthropic streaming sequence), and the same bytes must pass the anthropic
SDK's strict stream helpers."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
from anthropic.types import MessageParam

from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

pytestmark = pytest.mark.model

HELLO, WORLD, BANG = 19556, 905, 17  # "Hello", " world", "!" in SmolLM2
NUM_HI_PROMPT_TOKENS = 31  # [{"role": "user", "content": "hi"}] with SmolLM2's default system prompt
HI: list[MessageParam] = [{"role": "user", "content": "hi"}]


def event(name: str, data: str) -> str:
    return f"event: {name}\ndata: {data}\n\n"


def message_start(usage: str) -> str:
    return event(
        "message_start",
        '{"type":"message_start","message":{"id":"ID","type":"message","role":"assistant",'
        '"model":"smollm2-test","content":[],"stop_reason":null,"stop_sequence":null,"usage":' + usage + "}}",
    )


def text_delta(text: str) -> str:
    return event(
        "content_block_delta",
        '{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"' + text + '"}}',
    )


def message_delta(stop_reason: str, stop_sequence: str, usage: str) -> str:
    return event(
        "message_delta",
        '{"type":"message_delta","delta":{"stop_reason":"'
        + stop_reason
        + '","stop_sequence":'
        + stop_sequence
        + '},"usage":'
        + usage
        + "}",
    )


OPEN = event(
    "content_block_start",
    '{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}',
) + event("ping", '{"type":"ping"}')
CLOSE_BLOCK = event("content_block_stop", '{"type":"content_block_stop","index":0}')
STOP = event("message_stop", '{"type":"message_stop"}')


def usage(num_input: int, num_output: int, num_cached: int, *, by_ttl: bool = True) -> str:
    """message_start's usage (`by_ttl`: with the cache_creation split), or message_delta's."""
    split = ',"cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":0}'
    split = split if by_ttl else ""
    return (
        f'{{"input_tokens":{num_input},"output_tokens":{num_output},'
        f'"cache_creation_input_tokens":0,"cache_read_input_tokens":{num_cached}{split}}}'
    )


# 31 prompt tokens, 4 of them cached: 27 uncached. Output: three text tokens and EOS.
GOLDEN_END_TURN = (
    message_start(usage(27, 1, 4))
    + OPEN
    + text_delta("Hello")
    + text_delta(" world")
    + text_delta("!")
    + CLOSE_BLOCK
    + message_delta("end_turn", "null", usage(27, 4, 4, by_ttl=False))
    + STOP
)

GOLDEN_STOP_SEQUENCE = (
    message_start(usage(31, 1, 0))
    + OPEN
    + text_delta("Hello")
    + CLOSE_BLOCK
    + message_delta("stop_sequence", '" wor"', usage(31, 2, 0, by_ttl=False))
    + STOP
)

GOLDEN_MAX_TOKENS = (
    message_start(usage(31, 1, 0))
    + OPEN
    + text_delta("Hello")
    + text_delta(" world")
    + CLOSE_BLOCK
    + message_delta("max_tokens", "null", usage(31, 2, 0, by_ttl=False))
    + STOP
)

GOLDEN_FAILS_MID_STREAM = (
    message_start(usage(31, 1, 0))
    + OPEN
    + text_delta("Hello")
    + text_delta(" world")
    + event(
        "error",
        '{"type":"error","error":{"type":"api_error",'
        '"message":"generation failed in the serving stack (request golden-1)"}}',
    )
)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path) -> FakeBackend:
    return FakeBackend(identity_for(model_dir).tokenizer_fingerprint)


@pytest.fixture
def client(model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend) -> httpx.AsyncClient:
    app = make_app(tokenizer, fake, identity_for(model_dir))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec")


async def transcript(client: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> str:
    """The response body with the per-request message id replaced by a placeholder."""
    request = {"model": MODEL_NAME, "max_tokens": 16, "messages": HI, "stream": True, **body}
    response = await client.post("/v1/messages", json=request, headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["request-id"] == response.headers["x-request-id"]
    text = response.text
    assert "\r" not in text
    return re.sub(r'"id":"msg_[0-9a-f]{32}"', '"id":"ID"', text)


def replay(golden: str) -> anthropic.Anthropic:
    """A strict SDK client whose every response is `golden`."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=golden.encode())

    return anthropic.Anthropic(
        base_url="http://golden",
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


def final_message(golden: str) -> anthropic.types.Message:
    with replay(golden).messages.stream(model=MODEL_NAME, max_tokens=16, messages=HI) as stream:
        return stream.get_final_message()


async def test_end_turn_stream_is_byte_exact(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO, WORLD, BANG]], num_cached_tokens=4)
    assert await transcript(client, {}) == GOLDEN_END_TURN
    assert len(fake.seen[0].prompt_token_ids) == NUM_HI_PROMPT_TOKENS
    message = final_message(GOLDEN_END_TURN)
    assert [block.type for block in message.content] == ["text"]
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert message.usage.input_tokens == 27 and message.usage.output_tokens == 4
    assert message.usage.cache_read_input_tokens == 4 and message.usage.cache_creation_input_tokens == 0
    with replay(GOLDEN_END_TURN).messages.stream(model=MODEL_NAME, max_tokens=16, messages=HI) as stream:
        assert stream.get_final_text() == "Hello world!"


async def test_stop_sequence_stream_is_byte_exact(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO, WORLD, BANG]])
    assert await transcript(client, {"stop_sequences": [" wor"]}) == GOLDEN_STOP_SEQUENCE
    assert fake.seen[0].request_id in fake.closed_early  # the engine's run past the stop is aborted
    message = final_message(GOLDEN_STOP_SEQUENCE)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", " wor")
    assert message.content[0].type == "text" and message.content[0].text == "Hello"


async def test_max_tokens_stream_is_byte_exact(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO, WORLD]], "length")
    assert await transcript(client, {"max_tokens": 2}) == GOLDEN_MAX_TOKENS
    assert fake.seen[0].sampling.max_tokens == 2
    message = final_message(GOLDEN_MAX_TOKENS)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 2)


async def test_mid_stream_failure_is_one_error_event_then_close(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    fake.script = scripted([[HELLO, WORLD, BANG]])
    fake.fail_after = 2
    assert await transcript(client, {}, **{"x-request-id": "golden-1"}) == GOLDEN_FAILS_MID_STREAM
    with pytest.raises(anthropic.APIStatusError, match="generation failed") as caught:
        final_message(GOLDEN_FAILS_MID_STREAM)
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "api_error",
            "message": "generation failed in the serving stack (request golden-1)",
        },
    }
