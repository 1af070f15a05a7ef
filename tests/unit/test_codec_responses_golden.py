"""Golden SSE transcripts for `POST /v1/responses`: a fixed fake token stream must give exactly these
bytes (written by hand from the Responses streaming lifecycle in protocols.md §2.3, IDs and timestamps
replaced by placeholders); every event validates against the Open Responses schemas, and the same bytes
pass the openai SDK's strict parser (which raises `APIError` at a failed stream's `error` event)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest

from services.codec.text.tokenizer import Tokenizer
from tests import openresponses_schemas as spec
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

pytestmark = pytest.mark.model

HELLO, WORLD, BANG = 19556, 905, 17  # "Hello", " world", "!" in SmolLM2
NUM_HI_PROMPT_TOKENS = 31  # input "hi" with SmolLM2's default system prompt
# The Open Responses schema's required keys (protocols.md §2.2): all present on every response object.
SPEC_KEYS = (
    "id object created_at completed_at status incomplete_details model previous_response_id instructions "
    "output error tools tool_choice truncation parallel_tool_calls text top_p presence_penalty "
    "frequency_penalty top_logprobs temperature reasoning user usage max_output_tokens max_tool_calls "
    "store background service_tier metadata safety_identifier prompt_cache_key"
)
RESPONSE_KEYS = set(SPEC_KEYS.split())


def response(
    status: str,
    output: str = "[]",
    *,
    completed_at: str = "null",
    error: str = "null",
    incomplete_details: str = "null",
    max_output_tokens: str = "null",
    usage: str = "null",
) -> str:
    """The response object with all 32 keys, in the order the server writes them."""
    return (
        '{"id":"resp_ID","object":"response","created_at":0,"completed_at":' + completed_at + ","
        '"status":"' + status + '","error":' + error + ',"incomplete_details":' + incomplete_details + ","
        '"output":' + output + ',"model":"smollm2-test","instructions":null,'
        '"max_output_tokens":' + max_output_tokens + ',"max_tool_calls":null,"previous_response_id":null,'
        '"store":true,"background":false,"temperature":1.0,"top_p":1.0,"presence_penalty":0.0,'
        '"frequency_penalty":0.0,"top_logprobs":0,"reasoning":null,"text":{"format":{"type":"text"}},'
        '"tools":[],"tool_choice":"auto","parallel_tool_calls":true,"truncation":"disabled",'
        '"service_tier":"default","metadata":{},"user":null,"safety_identifier":null,'
        '"prompt_cache_key":null,"usage":' + usage + "}"
    )


def event(kind: str, rest: str) -> str:
    return f'event: {kind}\ndata: {{"type":"{kind}",{rest}}}\n\n'


def part(text: str) -> str:
    return '{"type":"output_text","text":"' + text + '","annotations":[],"logprobs":[]}'


def message(status: str, content: str) -> str:
    """A plain reply's message: no call can follow it, so it is the final answer from the start."""
    return (
        '{"type":"message","id":"msg_ID","status":"'
        + status
        + '","role":"assistant","content":'
        + content
        + ',"phase":"final_answer"}'
    )


PLACE = '"item_id":"msg_ID","output_index":0,"content_index":0'
OPENING = (
    event("response.created", '"sequence_number":0,"response":' + response("in_progress"))
    + event("response.in_progress", '"sequence_number":1,"response":' + response("in_progress"))
    + event(
        "response.output_item.added",
        '"sequence_number":2,"output_index":0,"item":' + message("in_progress", "[]"),
    )
    + event("response.content_part.added", '"sequence_number":3,' + PLACE + ',"part":' + part(""))
)
DONE = "data: [DONE]\n\n"


def delta(number: int, text: str) -> str:
    return event(
        "response.output_text.delta", f'"sequence_number":{number},{PLACE},"delta":"{text}","logprobs":[]'
    )


USAGE_35 = (
    '{"input_tokens":31,"input_tokens_details":{"cached_tokens":4,"cache_write_tokens":0},'
    '"output_tokens":4,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":35}'
)
HELLO_WORLD_BANG = message("completed", "[" + part("Hello world!") + "]")
GOLDEN_COMPLETED = (
    OPENING
    + delta(4, "Hello")
    + delta(5, " world")
    + delta(6, "!")
    + event(
        "response.output_text.done", '"sequence_number":7,' + PLACE + ',"text":"Hello world!","logprobs":[]'
    )
    + event("response.content_part.done", '"sequence_number":8,' + PLACE + ',"part":' + part("Hello world!"))
    + event("response.output_item.done", '"sequence_number":9,"output_index":0,"item":' + HELLO_WORLD_BANG)
    + event(
        "response.completed",
        '"sequence_number":10,"response":'
        + response("completed", "[" + HELLO_WORLD_BANG + "]", completed_at="0", usage=USAGE_35),
    )
    + DONE
)

USAGE_33 = (
    '{"input_tokens":31,"input_tokens_details":{"cached_tokens":0,"cache_write_tokens":0},'
    '"output_tokens":2,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":33}'
)
HELLO_WORLD_CUT = message("incomplete", "[" + part("Hello world") + "]")
GOLDEN_INCOMPLETE = (
    OPENING.replace('"max_output_tokens":null', '"max_output_tokens":2')
    + delta(4, "Hello")
    + delta(5, " world")
    + event(
        "response.output_text.done", '"sequence_number":6,' + PLACE + ',"text":"Hello world","logprobs":[]'
    )
    + event("response.content_part.done", '"sequence_number":7,' + PLACE + ',"part":' + part("Hello world"))
    + event("response.output_item.done", '"sequence_number":8,"output_index":0,"item":' + HELLO_WORLD_CUT)
    + event(
        "response.incomplete",
        '"sequence_number":9,"response":'
        + response(
            "incomplete",
            "[" + HELLO_WORLD_CUT + "]",
            completed_at="0",
            incomplete_details='{"reason":"max_output_tokens"}',
            max_output_tokens="2",
            usage=USAGE_33,
        ),
    )
    + DONE
)

FAILURE = "generation failed in the serving stack (request golden-1)"
ERROR_PAYLOAD = '{"type":"server_error","code":"server_error","message":"' + FAILURE + '","param":null}'
GOLDEN_FAILED = (
    OPENING
    + delta(4, "Hello")
    + delta(5, " world")
    + event(
        "error",
        '"sequence_number":6,"code":"server_error","message":"'
        + FAILURE
        + '","param":null,"error":'
        + ERROR_PAYLOAD,
    )
    + event(
        "response.failed",
        '"sequence_number":7,"response":'
        + response(
            "failed",
            "[" + message("incomplete", "[" + part("Hello world") + "]") + "]",
            error='{"code":"server_error","message":"' + FAILURE + '"}',
        ),
    )
    + DONE
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
    """The stream's bytes with its one response ID, one message ID and timestamps as placeholders."""
    payload = {"model": MODEL_NAME, "input": "hi", "stream": True, **body}
    response = await client.post("/v1/responses", json=payload, headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    text = response.text
    assert "\r" not in text
    assert len(set(re.findall(r"resp_[0-9a-f]{32}", text))) == 1
    assert len(set(re.findall(r"msg_[0-9a-f]{32}", text))) == 1
    check_sequence(text)
    text = re.sub(r"resp_[0-9a-f]{32}", "resp_ID", re.sub(r"msg_[0-9a-f]{32}", "msg_ID", text))
    return re.sub(r'"(created_at|completed_at)":\d+', r'"\1":0', text)


def check_sequence(text: str) -> None:
    """Each event's `event:` equals its `type`, sequence numbers count up from 0, every event validates
    against its Open Responses schema, and every lifecycle event's response has the 32 keys."""
    numbers = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        if lines == ["data: [DONE]"]:
            continue
        data = json.loads(lines[1].removeprefix("data: "))
        assert lines[0] == f"event: {data['type']}"
        spec.validate_stream_event(data)
        numbers.append(data["sequence_number"])
        if "response" in data:
            assert set(data["response"]) == RESPONSE_KEYS
    assert numbers == list(range(len(numbers)))


def replay(golden: str) -> openai.OpenAI:
    """A strict SDK client whose every response is `golden`."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=golden.encode())

    return openai.OpenAI(
        base_url="http://golden/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


async def test_completed_stream_is_byte_exact(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO, WORLD, BANG]], num_cached_tokens=4)
    assert await transcript(client, {}) == GOLDEN_COMPLETED
    assert len(fake.seen[0].prompt_token_ids) == NUM_HI_PROMPT_TOKENS
    assert len(RESPONSE_KEYS) == 32
    with replay(GOLDEN_COMPLETED).responses.stream(model=MODEL_NAME, input="hi") as stream:
        final = stream.get_final_response()
    assert final.output_text == "Hello world!"
    assert final.status == "completed"
    assert final.usage is not None and final.usage.total_tokens == 35
    assert final.usage.input_tokens_details.cached_tokens == 4


async def test_incomplete_stream_is_byte_exact(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO, WORLD]], "length")
    assert await transcript(client, {"max_output_tokens": 2}) == GOLDEN_INCOMPLETE
    assert fake.seen[0].sampling.max_tokens == 2
    events = list(replay(GOLDEN_INCOMPLETE).responses.create(model=MODEL_NAME, input="hi", stream=True))
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == "Hello world"
    # The SDK's helper needs response.completed, so it cannot return an incomplete response.
    with (
        replay(GOLDEN_INCOMPLETE).responses.stream(model=MODEL_NAME, input="hi") as stream,
        pytest.raises(RuntimeError, match=r"response\.completed"),
    ):
        stream.get_final_response()


async def test_mid_stream_failure_is_error_then_response_failed(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    fake.script = scripted([[HELLO, WORLD, BANG]])
    fake.fail_after = 2
    assert await transcript(client, {}, **{"x-request-id": "golden-1"}) == GOLDEN_FAILED
    # The SDK raises at an event with an `error` object (the spec's error event has one).
    seen = []
    with pytest.raises(openai.APIError) as raised:
        for sdk_event in replay(GOLDEN_FAILED).responses.create(model=MODEL_NAME, input="hi", stream=True):
            seen.append(sdk_event.type)
    assert seen[-1] == "response.output_text.delta"
    assert raised.value.message == FAILURE and raised.value.body == json.loads(ERROR_PAYLOAD)


async def test_failed_stream_is_not_stored(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO, WORLD, BANG]])
    fake.fail_after = 2
    response = await client.post("/v1/responses", json={"model": MODEL_NAME, "input": "hi", "stream": True})
    response_id = re.findall(r"resp_[0-9a-f]{32}", response.text)[0]
    assert (await client.get(f"/v1/responses/{response_id}")).status_code == 404
