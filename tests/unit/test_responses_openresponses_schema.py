"""Every object and event `/v1/responses` emits validates against the vendored Open Responses schemas
(tests/openresponses_schemas.py loads them from tests/fixtures/openresponses): the real codec app,
in process, with scripted SmolLM2 tokens from the fake backend. Each case runs non-streamed and streamed;
a streamed case validates every event by its type's schema, and the response object inside each
lifecycle event. Beyond the schemas: output_text parts carry `annotations` and `logprobs`, `completed_at`
is an integer once the response is completed or incomplete (null before), assistant messages carry
`phase` (commentary before a call, final_answer otherwise), and streamed content is opened by
`response.content_part.added`. The vendored files must match tests/fixtures/openresponses.sha256."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, LimitsConfig, ModelConfig
from tests import openresponses_schemas as spec
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

pytestmark = pytest.mark.model

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK = "What is the weather in Paris?"
ARGUMENTS = '{"city": "Paris"}'
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGUMENTS + "}\n</tool_call>"
THINKING_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}"
)
THOUGHT_THEN_ANSWER = "<think>\nThe user greets me.\n</think>\n\nHello world!"
LIFECYCLE = {"response.created", "response.in_progress", "response.completed", "response.incomplete"}
FINAL_STATUS = {"response.completed": "completed", "response.incomplete": "incomplete"}


# ---- fixtures and helpers ----


@pytest.fixture
async def client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(tokenizer, fake, identity_for(model_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


@pytest.fixture
async def thinking_client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend, tmp_path: Path
) -> AsyncIterator[httpx.AsyncClient]:
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE, encoding="utf-8")
    config = KvrelayConfig(limits=LimitsConfig(), model=ModelConfig(chat_template=str(template)))
    app = make_app(tokenizer, fake, identity_for(model_dir), config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


async def post(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    response = await client.post("/v1/responses", json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response


def stream_events(text: str) -> list[dict[str, Any]]:
    """The stream's events (data objects), in order, ending with `data: [DONE]`."""
    blocks = text.strip().split("\n\n")
    assert blocks[-1] == "data: [DONE]"
    events = []
    for block in blocks[:-1]:
        lines = block.split("\n")
        data = json.loads(lines[1].removeprefix("data: "))
        assert lines[0] == f"event: {data['type']}"
        events.append(data)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def check_response(body: dict[str, Any], status: str) -> None:
    """The response object validates, and what the schema leaves open holds."""
    spec.validate("ResponseResource", body)
    assert body["status"] == status
    if status in ("completed", "incomplete"):
        assert isinstance(body["completed_at"], int) and body["completed_at"] >= body["created_at"]
    else:
        assert body["completed_at"] is None
    assert body["usage"] is None if status in ("in_progress", "failed") else isinstance(body["usage"], dict)
    for item in body["output"]:
        check_item(item)


def check_item(item: dict[str, Any], *, phase_expected: bool = True) -> None:
    spec.validate("ItemField", item)
    if item["type"] == "message":
        assert item["role"] == "assistant"
        if phase_expected:
            assert item["phase"] in ("commentary", "final_answer"), item
        for part in item["content"]:
            check_text_part(part)


def check_text_part(part: dict[str, Any]) -> None:
    if part["type"] == "output_text":
        assert part["annotations"] == [] and part["logprobs"] == [], part


def check_stream(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Validates every event by its type's schema and the spec's content-part framing; returns the
    final response object (of response.completed or response.incomplete)."""
    opened: set[tuple[str, int]] = set()
    for event in events:
        spec.validate_stream_event(event)
        kind = event["type"]
        if kind in LIFECYCLE:
            check_response(event["response"], FINAL_STATUS.get(kind, "in_progress"))
        if kind == "response.content_part.added":
            opened.add((event["item_id"], event["content_index"]))
            check_text_part(event["part"])
        if kind in ("response.output_text.delta", "response.reasoning.delta"):
            assert (event["item_id"], event["content_index"]) in opened, "a delta before its content part"
        if kind in ("response.output_text.delta", "response.output_text.done"):
            assert event["logprobs"] == []
        if kind == "response.content_part.done":
            check_text_part(event["part"])
        if kind == "response.output_item.done":
            check_item(event["item"])
    final = events[-1]
    assert final["type"] in FINAL_STATUS, final["type"]
    return final["response"]


def items_added(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [event["item"] for event in events if event["type"] == "response.output_item.added"]


async def respond(client: httpx.AsyncClient, stream: bool, **body: Any) -> dict[str, Any]:
    """The final response object of one request, every object and event validated on the way."""
    response = await post(client, stream=stream, **body)
    if not stream:
        final: dict[str, Any] = response.json()
        check_response(final, final["status"])
        return final
    return check_stream(stream_events(response.text))


# ---- responses ----


@pytest.mark.parametrize("stream", [False, True])
async def test_a_plain_reply_is_one_final_answer(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world!")])
    final = await respond(client, stream, input="hi")
    assert final["status"] == "completed" and final["incomplete_details"] is None
    [message] = final["output"]
    assert message["phase"] == "final_answer" and message["status"] == "completed"
    assert message["content"] == [
        {"type": "output_text", "text": "Hello world!", "annotations": [], "logprobs": []}
    ]


async def test_a_plain_reply_states_its_phase_from_the_start(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world!")])
    events = stream_events((await post(client, input="hi", stream=True)).text)
    [added] = items_added(events)
    assert added["phase"] == "final_answer" and added["content"] == []
    created = events[0]["response"]
    assert created["completed_at"] is None and created["output"] == []


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reply_cut_by_max_output_tokens_is_incomplete(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    cut = ids(tokenizer, "Hello world, how are you")[:3]
    fake.script = scripted([cut], "length")
    final = await respond(client, stream, input="hi", max_output_tokens=len(cut))
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = final["output"]
    assert message["status"] == "incomplete" and message["phase"] == "final_answer"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_forced_call_is_a_function_call_item(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    fake.script = scripted([ids(tokenizer, CALL_TEXT)])
    final = await respond(client, stream, input=ASK, tools=[WEATHER], tool_choice="required")
    [call] = final["output"]
    assert call["type"] == "function_call" and call["arguments"] == ARGUMENTS
    assert final["tools"] == [WEATHER]


@pytest.mark.parametrize("stream", [False, True])
async def test_text_before_a_call_is_commentary(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    fake.script = scripted([ids(tokenizer, "Let me check.\n" + CALL_TEXT)])
    final = await respond(client, stream, input=ASK, tools=[WEATHER])
    message, call = final["output"]
    assert message["phase"] == "commentary" and call["type"] == "function_call"


async def test_a_message_that_may_precede_a_call_states_its_phase_when_it_ends(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Let me check.\n" + CALL_TEXT)])
    events = stream_events((await post(client, input=ASK, tools=[WEATHER], stream=True)).text)
    message_added = items_added(events)[0]
    assert message_added["type"] == "message" and "phase" not in message_added
    done = [event["item"] for event in events if event["type"] == "response.output_item.done"]
    assert done[0]["phase"] == "commentary"


@pytest.mark.parametrize("stream", [False, True])
async def test_text_when_a_call_was_possible_but_not_made_is_the_final_answer(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    fake.script = scripted([ids(tokenizer, "Sunny, I think.")])
    final = await respond(client, stream, input=ASK, tools=[WEATHER])
    [message] = final["output"]
    assert message["phase"] == "final_answer"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_cut_by_max_output_tokens_is_incomplete(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    cut = ids(tokenizer, CALL_TEXT)[:-8]
    fake.script = scripted([cut], "length")
    final = await respond(
        client, stream, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=len(cut)
    )
    [call] = final["output"]
    assert final["status"] == "incomplete" and call["status"] == "incomplete"


@pytest.mark.parametrize("stream", [False, True])
async def test_thinking_is_a_reasoning_item_then_the_final_answer(
    thinking_client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    fake.script = scripted([ids(tokenizer, THOUGHT_THEN_ANSWER)])
    final = await respond(thinking_client, stream, input="hi", reasoning={"effort": "low"})
    reasoning, message = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["type"] == "reasoning_text"
    assert message["phase"] == "final_answer"
    assert final["reasoning"] == {"effort": "low", "summary": None}


async def test_reasoning_streams_in_a_content_part_with_the_specs_events(
    thinking_client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, THOUGHT_THEN_ANSWER)])
    response = await post(thinking_client, input="hi", reasoning={"effort": "low"}, stream=True)
    events = stream_events(response.text)
    kinds = [event["type"] for event in events]
    deltas = kinds.count("response.reasoning.delta")
    assert deltas >= 2
    assert kinds[2 : 8 + deltas] == [
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning.delta"] * deltas,
        "response.reasoning.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
    ]
    added, done = events[3]["part"], events[5 + deltas]["part"]
    assert added == {"type": "reasoning_text", "text": ""}
    assert done == {"type": "reasoning_text", "text": events[4 + deltas]["text"]}


@pytest.mark.parametrize("stream", [False, True])
async def test_every_echoed_setting_validates(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    fake.script = scripted([ids(tokenizer, '{"city": "Paris"}')])
    text_format = {"type": "json_schema", "name": "city", "schema": WEATHER["parameters"]}
    final = await respond(
        client,
        stream,
        input=ASK,
        instructions="Answer in JSON.",
        text={"format": text_format},
        tools=[{**WEATHER, "description": None, "strict": False}],
        tool_choice={
            "type": "allowed_tools",
            "mode": "auto",
            "tools": [{"type": "function", "name": "get_weather"}],
        },
        temperature=0.5,
        top_p=0.9,
        max_tool_calls=2,
        parallel_tool_calls=False,
        metadata={"k": "v"},
        user="u-1",
        safety_identifier="s-1",
        prompt_cache_key="c-1",
        store=False,
    )
    assert final["text"]["format"] == {**text_format, "description": None, "strict": False}
    assert (final["instructions"], final["metadata"], final["store"]) == (
        "Answer in JSON.",
        {"k": "v"},
        False,
    )


# ---- failures ----


@pytest.mark.parametrize(
    ("text", "fields", "fail_after", "open_kind"),
    [
        ("Hello world, how are you?", {"reasoning": {"effort": "none"}}, 3, "message"),
        (CALL_TEXT, {"tools": [WEATHER], "tool_choice": "required"}, -8, "function_call"),
        (THOUGHT_THEN_ANSWER, {"reasoning": {"effort": "low"}}, 5, "reasoning"),
    ],
    ids=["message", "call", "reasoning"],
)
async def test_a_mid_stream_failure_is_a_valid_error_then_response_failed(
    thinking_client: httpx.AsyncClient,
    fake: FakeBackend,
    tokenizer: Tokenizer,
    text: str,
    fields: Any,
    fail_after: int,
    open_kind: str,
) -> None:
    tokens = ids(tokenizer, text)
    fake.script = scripted([tokens])
    fake.fail_after = fail_after % len(tokens)
    response = await post(thinking_client, input=ASK, stream=True, **fields)
    events = stream_events(response.text)
    for event in events:
        spec.validate_stream_event(event)
    error, failed = events[-2:]
    assert (error["type"], failed["type"]) == ("error", "response.failed")
    assert error["error"]["type"] == "server_error" and error["error"]["message"]
    assert (error["code"], error["message"], error["param"]) == (
        error["error"]["code"],
        error["error"]["message"],
        error["error"]["param"],
    )
    body = failed["response"]
    check_response(body, "failed")
    assert body["error"]["code"] == "server_error"
    [item] = body["output"]  # the item open when it failed, as it was then
    check_item(item, phase_expected=False)
    assert item["type"] == open_kind and item.get("status", "incomplete") == "incomplete"


# ---- stored responses ----


@pytest.mark.parametrize("stream", [False, True])
async def test_get_and_delete_of_a_stored_response_validate(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    fake.script = scripted([ids(tokenizer, "Let me check.\n" + CALL_TEXT)])
    final = await respond(client, stream, input=ASK, tools=[WEATHER])
    stored = await client.get(f"/v1/responses/{final['id']}")
    assert stored.status_code == 200
    check_response(stored.json(), "completed")
    assert stored.json() == final
    deleted = await client.delete(f"/v1/responses/{final['id']}")
    assert deleted.status_code == 200
    spec.validate("DeletedResponseResource", deleted.json())
    assert deleted.json() == {"id": final["id"], "object": "response.deleted", "deleted": True}


async def test_a_continuation_that_resends_the_output_with_its_phase_validates(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Let me check.\n" + CALL_TEXT)])
    first = await respond(client, False, input=ASK, tools=[WEATHER])
    message, call = first["output"]
    fake.script = scripted([ids(tokenizer, "It is sunny.")])
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    second = await respond(client, False, input=[{"role": "user", "content": ASK}, message, call, answer])
    assert second["output"][0]["phase"] == "final_answer"


# ---- the helper and the vendored files ----


def test_the_vendored_specification_matches_its_recorded_digests() -> None:
    recorded = spec.read_manifest()
    found = spec.sha256_manifest()
    changed = sorted(path for path in recorded.keys() & found.keys() if recorded[path] != found[path])
    assert not changed, f"vendored Open Responses files changed: {changed}"
    assert not recorded.keys() - found.keys(), f"missing: {sorted(recorded.keys() - found.keys())}"
    assert not found.keys() - recorded.keys(), f"not recorded: {sorted(found.keys() - recorded.keys())}"


def test_the_stream_event_map_comes_from_the_schemas() -> None:
    events = spec.stream_event_schemas()
    assert events["response.created"] == "ResponseCreatedStreamingEvent"
    assert events["response.output_text.delta"] == "ResponseOutputTextDeltaStreamingEvent"
    assert events["response.reasoning.delta"] == "ResponseReasoningDeltaStreamingEvent"
    assert events["error"] == "ErrorStreamingEvent"
    assert "response.reasoning_text.delta" not in events
    with pytest.raises(spec.SchemaMismatchError, match="no Open Responses streaming event"):
        spec.validate_stream_event({"type": "response.reasoning_text.delta"})


def test_a_mismatch_names_the_schema_and_the_path() -> None:
    item = {"type": "message", "id": "m", "status": "completed", "role": "assistant"}
    part = {"type": "output_text", "text": "x"}
    with pytest.raises(spec.SchemaMismatchError) as raised:
        spec.validate(
            "ResponseOutputItemDoneStreamingEvent",
            {
                "type": "response.output_item.done",
                "sequence_number": 0,
                "output_index": 0,
                "item": {**item, "content": [part]},
            },
        )
    message = str(raised.value)
    assert message.startswith("ResponseOutputItemDoneStreamingEvent rejects")
    assert re.search(r"\$\.item\.content\[0\]: 'annotations' is a required property", message), message
    spec.validate("Message", {**item, "content": [{**part, "annotations": []}], "phase": "commentary"})
    assert not spec.is_valid("Message", {**item, "content": [], "phase": "thinking"})
    with pytest.raises(KeyError):
        spec.validate("NoSuchSchema", {})
