"""Function tools and reasoning on `POST /v1/responses` (issue 24), against a fake backend that plays
scripted SmolLM2 tokens: bad tools and calls are 400s no worker sees; a forced call streams as
`function_call` item events the strict openai SDK accepts; function_call and function_call_output input
items reach the tool-aware template, also through `previous_response_id`; a thinking template's block
comes back as a `reasoning` item."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest

from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, LimitsConfig, ModelConfig
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
UNSUPPORTED = "unsupported_parameter"
# A ChatML template with a thinking mode (Qwen3's way): thinking off writes an empty block.
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


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path) -> FakeBackend:
    return FakeBackend(identity_for(model_dir).tokenizer_fingerprint)


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


def prompt_text(tokenizer: Tokenizer, fake: FakeBackend, number: int = 0) -> str:
    return tokenizer.decode(fake.seen[number].prompt_token_ids, skip_special_tokens=False)


def stream_events(text: str) -> list[dict[str, Any]]:
    """The stream's events (data objects) in order; each `event:` line equals its data's type."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        if lines == ["data: [DONE]"]:
            continue
        data = json.loads(lines[1].removeprefix("data: "))
        assert lines[0] == f"event: {data['type']}"
        events.append(data)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    return events


def replay(stream_text: str, *, strict: bool = True) -> openai.OpenAI:
    """An SDK client whose every response is `stream_text`: strict unless told (the strict parser rejects
    the Open Responses reasoning events, `response.reasoning.delta` and `.done`, which it does not know)."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(
            200, headers={"content-type": "text/event-stream"}, content=stream_text.encode()
        )

    return openai.OpenAI(
        base_url="http://replay/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=strict,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


async def post(client: httpx.AsyncClient, **body: Any) -> httpx.Response:
    return await client.post("/v1/responses", json={"model": MODEL_NAME, **body})


def assert_400(response: httpx.Response, param: str, code: str | None = None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert (error["param"], error["code"]) == (param, code)


# ---- bad input ----


def tool(**fields: Any) -> dict[str, Any]:
    return {**WEATHER, **fields}


def allowed(mode: str, *tools: dict[str, Any]) -> dict[str, Any]:
    return {"type": "allowed_tools", "mode": mode, "tools": list(tools)}


BAD = [
    ({"tools": [tool(parameters={"type": "string"})]}, "tools[0]", None),
    ({"tools": [tool(parameters={"type": "object", "properties": {"city": {"type": 5}}})]}, "tools[0]", None),
    ({"tools": [tool(parameters=[1])]}, "tools[0].parameters", None),
    ({"tools": [tool(name="no spaces")]}, "tools[0].name", None),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name", None),
    ({"tools": [tool(colour="red")]}, "tools[0].colour", "unknown_parameter"),
    ({"tools": [{"type": "web_search"}]}, "tools", UNSUPPORTED),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", None),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice.name", None),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice", None),
    (
        {"tools": [WEATHER], "tool_choice": allowed("required", {"type": "function", "name": "nope"})},
        "tool_choice",
        None,
    ),
    ({"tools": [WEATHER], "tool_choice": allowed("sometimes")}, "tool_choice.mode", None),
    (
        {"tools": [WEATHER], "tool_choice": allowed("auto", {"type": "web_search"})},
        "tool_choice.tools[0]",
        UNSUPPORTED,
    ),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice", UNSUPPORTED),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", None),
    (
        {"input": [{"type": "function_call_output", "call_id": "call_1", "output": "x"}]},
        "input[0].call_id",
        None,
    ),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id", None),
    (
        {
            "input": [
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{"},
            ]
        },
        "input[0].arguments",
        None,
    ),
    (
        {
            "input": [
                {"type": "function_call_output", "call_id": "call_1", "output": "x"},
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            ]
        },
        "input[0].call_id",
        None,
    ),
    (
        {
            "input": [
                {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "call_1",
                    "output": [{"type": "input_image", "image_url": "http://x/y.png"}],
                },
            ]
        },
        "input[1].output[0]",
        UNSUPPORTED,
    ),
    (
        {"input": [{"type": "custom_tool_call", "call_id": "c", "name": "x", "input": ""}]},
        "input[0]",
        UNSUPPORTED,
    ),
]


@pytest.mark.parametrize(("fields", "param", "code"), BAD)
async def test_bad_tools_and_calls_are_400_before_any_worker(
    client: httpx.AsyncClient, fake: FakeBackend, fields: dict[str, Any], param: str, code: str | None
) -> None:
    for stream in (False, True):
        response = await post(client, **{"input": ASK, **fields, "stream": stream})
        assert_400(response, param, code)
    assert fake.seen == []


async def test_a_schema_the_grammar_engine_cannot_compile_is_400(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    # Valid JSON Schema, but strict compilation refuses a keyword the grammar engine does not implement.
    parameters = {"type": "object", "properties": {"n": {"type": "integer", "not": {"const": 3}}}}
    response = await post(client, input=ASK, tools=[tool(parameters=parameters)], tool_choice="required")
    assert_400(response, "tools")
    assert fake.seen == []


async def test_an_answer_to_a_call_the_stored_conversation_did_not_make_is_400(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello")])
    first = (await post(client, input=ASK)).json()
    fake.seen.clear()
    answer = {"type": "function_call_output", "call_id": "call_unknown", "output": "sunny"}
    response = await post(client, input=[answer], previous_response_id=first["id"])
    assert_400(response, "input[0].call_id")
    assert fake.seen == []


# ---- calls out ----


async def test_a_forced_call_streams_as_function_call_item_events(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, CALL_TEXT)])
    response = await post(
        client, input=ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, stream=True
    )
    assert response.status_code == 200, response.text
    events = stream_events(response.text)
    kinds = [event["type"] for event in events]
    num_deltas = kinds.count("response.function_call_arguments.delta")
    assert num_deltas >= 2  # the arguments stream as the model writes them
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * num_deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = events[2]["item"], events[-2]["item"]
    assert re.fullmatch(r"fc_[0-9a-f]{32}", added["id"]) and re.fullmatch(
        r"call_[0-9a-f]{24}", added["call_id"]
    )
    assert added == {**done, "arguments": "", "status": "in_progress"}
    assert done == {
        "type": "function_call",
        "id": added["id"],
        "call_id": added["call_id"],
        "name": "get_weather",
        "arguments": ARGUMENTS,
        "status": "completed",
    }
    deltas = [event for event in events if event["type"] == "response.function_call_arguments.delta"]
    assert all(set(d) == {"type", "sequence_number", "item_id", "output_index", "delta"} for d in deltas)
    assert all((d["item_id"], d["output_index"]) == (added["id"], 0) for d in deltas)
    assert "".join(d["delta"] for d in deltas) == ARGUMENTS
    assert events[-3] == {
        "type": "response.function_call_arguments.done",
        "sequence_number": events[-3]["sequence_number"],
        "item_id": added["id"],
        "output_index": 0,
        "arguments": ARGUMENTS,
    }
    final = events[-1]["response"]
    assert final["status"] == "completed" and final["output"] == [done]
    assert final["tools"] == [WEATHER] and final["tool_choice"] == "required"
    assert final["parallel_tool_calls"] is False
    # The tools reached the prompt (the shipped tool-aware template) and a grammar forced the call.
    assert '"name": "get_weather"' in prompt_text(tokenizer, fake) and "<tools>" in prompt_text(
        tokenizer, fake
    )
    grammar = fake.seen[0].sampling.grammar
    assert grammar is not None and "get_weather" in grammar.text
    # The strict SDK accepts the stream and parses the strict tool's arguments.
    with replay(response.text).responses.stream(model=MODEL_NAME, input=ASK, tools=[WEATHER]) as stream:
        sdk_kinds = [event.type for event in stream]
        sdk_final = stream.get_final_response()
    assert sdk_kinds == kinds
    call = sdk_final.output[0]
    assert call.type == "function_call" and call.parsed_arguments == {"city": "Paris"}


async def test_a_named_call_is_the_same_response_not_streamed(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, CALL_TEXT)])
    choice = {"type": "function", "name": "get_weather"}
    response = await post(client, input=ASK, tools=[WEATHER], tool_choice=choice)
    body = response.json()
    assert body["status"] == "completed" and body["tool_choice"] == choice
    parsed = openai.types.responses.Response.model_validate(body)  # the SDK's own type accepts it
    assert parsed.output[0].type == "function_call"
    [call] = body["output"]
    assert (call["type"], call["name"], call["arguments"], call["status"]) == (
        "function_call",
        "get_weather",
        ARGUMENTS,
        "completed",
    )


async def test_allowed_tools_limit_a_forced_call_to_the_allowed_ones(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, CALL_TEXT)])
    time_tool = tool(name="get_time", description="The time in a city.")
    choice = allowed("required", {"type": "function", "name": "get_weather"})
    body = (await post(client, input=ASK, tools=[time_tool, WEATHER], tool_choice=choice)).json()
    assert [item["name"] for item in body["output"]] == ["get_weather"]
    assert body["tool_choice"] == choice
    grammar = fake.seen[0].sampling.grammar
    assert grammar is not None and "get_weather" in grammar.text and "get_time" not in grammar.text
    assert "get_time" in prompt_text(tokenizer, fake)  # every tool stays in the prompt


async def test_text_then_an_auto_call_are_two_items_in_order(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Let me check.\n" + CALL_TEXT)])
    streamed = await post(client, input=ASK, tools=[WEATHER], stream=True)
    events = stream_events(streamed.text)
    kinds = [event["type"] for event in events]
    text_end = kinds.index("response.output_item.done")
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[text_end + 1 : text_end + 4] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",  # an auto call comes whole, once checked
        "response.function_call_arguments.done",
    ]
    final = events[-1]["response"]
    message, call = final["output"]
    assert message["type"] == "message" and message["status"] == "completed"
    assert message["content"][0]["text"] == "Let me check.\n"
    assert call["type"] == "function_call" and json.loads(call["arguments"]) == {"city": "Paris"}
    assert [event["output_index"] for event in events if event["type"] == "response.output_item.added"] == [
        0,
        1,
    ]
    fake.script = scripted([ids(tokenizer, "Let me check.\n" + CALL_TEXT)])
    whole = (await post(client, input=ASK, tools=[WEATHER])).json()
    assert [item["type"] for item in whole["output"]] == ["message", "function_call"]
    assert whole["output"][0]["content"] == message["content"]


async def test_an_auto_call_of_no_offered_tool_is_text(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    text = CALL_TEXT.replace("get_weather", "get_time")
    fake.script = scripted([ids(tokenizer, text)])
    body = (await post(client, input=ASK, tools=[WEATHER])).json()
    [message] = body["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == text


async def test_a_call_cut_by_max_output_tokens_is_incomplete(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    cut = ids(tokenizer, CALL_TEXT)[:-8]
    fake.script = scripted([cut], "length")
    response = await post(
        client, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=len(cut), stream=True
    )
    events = stream_events(response.text)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    [call] = final["response"]["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete"
    assert ARGUMENTS.startswith(call["arguments"]) and call["arguments"] != ARGUMENTS


async def test_a_failure_mid_call_fails_the_response_with_the_call_so_far(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    call_ids = ids(tokenizer, CALL_TEXT)
    fake.script = scripted([call_ids])
    fake.fail_after = len(call_ids) - 8  # inside the arguments
    response = await post(client, input=ASK, tools=[WEATHER], tool_choice="required", stream=True)
    events = stream_events(response.text)
    assert [event["type"] for event in events[-2:]] == ["error", "response.failed"]
    [call] = events[-1]["response"]["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete"
    assert call["arguments"] and ARGUMENTS.startswith(call["arguments"])
    with pytest.raises(openai.APIError):  # the SDK raises at the event with an `error` object
        list(
            replay(response.text).responses.create(model=MODEL_NAME, input=ASK, tools=[WEATHER], stream=True)
        )
    created = next(event for event in events if event["type"] == "response.created")
    assert (await client.get(f"/v1/responses/{created['response']['id']}")).status_code == 404


async def test_tool_choice_none_gives_text_without_tools_in_the_prompt(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Sunny, I think.")])
    body = (await post(client, input=ASK, tools=[WEATHER], tool_choice="none")).json()
    assert body["output"][0]["content"][0]["text"] == "Sunny, I think."
    assert "<tools>" not in prompt_text(tokenizer, fake)
    assert fake.seen[0].sampling.grammar is not None  # the call marker is masked


# ---- calls in ----


def call_item(call_id: str = "call_1", arguments: str = ARGUMENTS) -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": "get_weather", "arguments": arguments}


def output_item(call_id: str = "call_1", output: Any = "sunny, 21C") -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


async def test_call_items_render_into_the_template(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Sunny.")])
    items = [
        {"role": "user", "content": ASK},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "x"}],
        },
        call_item("call_1"),
        {**call_item("call_2", '{"city": "Lyon"}'), "id": "fc_2", "status": "completed"},
        output_item("call_1"),
        output_item("call_2", [{"type": "input_text", "text": "rain"}, {"type": "input_text", "text": "9C"}]),
    ]
    response = await post(client, input=items, tools=[WEATHER])
    assert response.status_code == 200, response.text
    prompt = prompt_text(tokenizer, fake)
    expected = (
        f"<|im_start|>user\n{ASK}<|im_end|>\n"
        "<|im_start|>assistant\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response>\n"
        "<tool_response>\nrain\n9C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt.endswith(expected), prompt
    assert "x<|im_end|>" not in prompt  # the reasoning item is dropped


async def test_text_before_calls_joins_their_assistant_turn(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Sunny.")])
    items = [
        {"role": "user", "content": ASK},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        call_item(),
        output_item(),
    ]
    assert (await post(client, input=items)).status_code == 200  # no tools: still the tool-aware template
    assert "<|im_start|>assistant\nChecking.\n<tool_call>\n" in prompt_text(tokenizer, fake)


@pytest.mark.parametrize("stream_first", [False, True])
@pytest.mark.parametrize("tools_again", [False, True])
async def test_previous_response_id_continues_with_the_function_call_output(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, stream_first: bool, tools_again: bool
) -> None:
    fake.script = scripted([ids(tokenizer, CALL_TEXT)])
    first = await post(client, input=ASK, tools=[WEATHER], tool_choice="required", stream=stream_first)
    final = stream_events(first.text)[-1]["response"] if stream_first else first.json()
    [call] = final["output"]
    stored = (await client.get(f"/v1/responses/{final['id']}")).json()
    assert stored["output"] == [call]

    fake.script = scripted([ids(tokenizer, "It is sunny in Paris.")])
    more = {"tools": [WEATHER]} if tools_again else {}
    second = await post(
        client, input=[output_item(call["call_id"], "sunny")], previous_response_id=final["id"], **more
    )
    assert second.status_code == 200, second.text
    body = second.json()
    assert body["status"] == "completed" and body["previous_response_id"] == final["id"]
    assert body["output"][0]["content"][0]["text"] == "It is sunny in Paris."
    prompt = prompt_text(tokenizer, fake, 1)
    expected = (
        f"<|im_start|>user\n{ASK}<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert prompt.endswith(expected), prompt

    # The answered call stays in the conversation: a third turn continues after the second's text.
    fake.script = scripted([ids(tokenizer, "You are welcome.")])
    third = await post(client, input="Thanks!", previous_response_id=body["id"])
    assert third.status_code == 200, third.text
    assert prompt_text(tokenizer, fake, 2).endswith(
        expected
        + "It is sunny in Paris.<|im_end|>\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n"
    )


# ---- reasoning ----


async def test_thinking_comes_back_as_a_reasoning_item(
    thinking_client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "<think>\nThe user greets me.\n</think>\n\nHello world!")])
    response = await post(thinking_client, input="hi", reasoning={"effort": "low"}, stream=True)
    assert response.status_code == 200, response.text
    events = stream_events(response.text)
    kinds = [event["type"] for event in events]
    reasoning_deltas = kinds.count("response.reasoning.delta")
    text_deltas = kinds.count("response.output_text.delta")
    assert reasoning_deltas >= 2 and text_deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.reasoning.delta"] * reasoning_deltas,
        "response.reasoning.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * text_deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    reasoning, message = final["output"]
    assert re.fullmatch(r"rs_[0-9a-f]{32}", reasoning["id"])
    assert reasoning["summary"] == [] and reasoning["type"] == "reasoning"
    [part] = reasoning["content"]
    assert part["type"] == "reasoning_text" and part["text"].strip() == "The user greets me."
    assert message["content"][0]["text"] == "Hello world!"
    assert final["reasoning"] == {"effort": "low", "summary": None}
    reasoning_done = events[kinds.index("response.reasoning.done")]
    assert reasoning_done["text"] == part["text"] and reasoning_done["content_index"] == 0
    # The budget is the grammar's: at most 1024 thinking tokens.
    grammar = fake.seen[0].sampling.grammar
    assert grammar is not None and "max_tokens=1024" in grammar.text
    with replay(response.text, strict=False).responses.stream(model=MODEL_NAME, input="hi") as stream:
        sdk_final = stream.get_final_response()
    assert sdk_final.output_text == "Hello world!"
    assert sdk_final.output[0].type == "reasoning"

    fake.script = scripted([ids(tokenizer, "<think>\nThe user greets me.\n</think>\n\nHello world!")])
    whole = (await post(thinking_client, input="hi", reasoning={"effort": "low"})).json()
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"]
    parsed = openai.types.responses.Response.model_validate(whole)
    assert parsed.reasoning is not None and parsed.reasoning.effort == "low"
    assert whole["output"][0]["content"] == reasoning["content"]


async def test_effort_none_turns_thinking_off(
    thinking_client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world!")])
    body = (await post(thinking_client, input="hi", reasoning={"effort": "none"})).json()
    assert [item["type"] for item in body["output"]] == ["message"]
    assert prompt_text(tokenizer, fake).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert fake.seen[0].sampling.grammar is None


async def test_reasoning_is_ignored_on_a_model_without_a_thinking_mode(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world!")])
    body = (await post(client, input="hi", reasoning={"effort": "high", "summary": "auto"})).json()
    assert body["reasoning"] is None and body["output"][0]["content"][0]["text"] == "Hello world!"
    assert fake.seen[0].sampling.grammar is None
