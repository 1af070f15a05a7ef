"""OpenAI Chat with tools at the codec (issue 24), a fake backend at the Backend seam on SmolLM2's tokenizer:
bad tools and tool messages are 400s no backend sees; the tools reach the prompt through the shipped
tool-aware ChatML template (SmolLM2's own ignores them); `none` masks the call marker and `required` /
named force calls by a Lark grammar; a call the backend writes comes back as streamed deltas (index, id,
name, then argument fragments) or as `message.tool_calls`, with finish_reason `tool_calls`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.codec.text.tokenizer import Tokenizer
from services.codec.text.tool_calls import JSON_FORM, Tool, ToolChoice, ToolChoiceMode, ToolSet
from services.common.grammar import GrammarKind
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted
from tests.unit.test_codec_bad_requests import assert_openai_error

pytestmark = pytest.mark.model

F_PARAMETERS = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
F = {"type": "function", "function": {"name": "f", "description": "Adds one.", "parameters": F_PARAMETERS}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMETERS}}
CALL_TEXT = '<tool_call>\n{"name":"f","arguments":{"a":1}}\n</tool_call>'
USER = [{"role": "user", "content": "Add one to 1."}]
CHAT = {"model": MODEL_NAME, "messages": USER, "max_tokens": 64, "tools": [F, WEATHER]}
ASSISTANT_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
}


def tool(parameters: Any, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "parameters not an object schema": ({"tools": [tool({"type": "string"})]}, "tools[0]"),
    "parameters not a schema at all": ({"tools": [tool([1])]}, "tools[0].function.parameters"),
    "schema does not compile": (
        {"tools": [F, tool({"type": "object", "properties": {"a": {"type": "nope"}}}, "g")]},
        "tools[1]",
    ),
    "schema the grammar engine cannot compile, forced": (
        {
            "tools": [tool({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}})],
            "tool_choice": "required",
        },
        "tools",
    ),
    "two tools of one name": ({"tools": [F, F]}, "tools[1].name"),
    "tool_choice names no tool": (
        {"tool_choice": {"type": "function", "function": {"name": "launch"}}},
        "tool_choice",
    ),
    "required without tools": ({"tools": [], "tool_choice": "required"}, "tool_choice"),
    "tool message answers no call": (
        {"messages": [*USER, ASSISTANT_CALL, {"role": "tool", "tool_call_id": "call_2", "content": "2"}]},
        "messages[2].tool_call_id",
    ),
    "tool message before any call": (
        {"messages": [*USER, {"role": "tool", "tool_call_id": "call_1", "content": "2"}]},
        "messages[1].tool_call_id",
    ),
    "assistant call arguments not JSON": (
        {
            "messages": [
                *USER,
                {
                    **ASSISTANT_CALL,
                    "tool_calls": [
                        {**ASSISTANT_CALL["tool_calls"][0], "function": {"name": "f", "arguments": "{"}}
                    ],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments",
    ),
}


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path, tokenizer: Tokenizer) -> FakeBackend:
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    backend.script = scripted([tokenizer.encode(CALL_TEXT)])
    return backend


@pytest.fixture
async def client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(tokenizer, fake, identity_for(model_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


async def chat(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    return await client.post("/v1/chat/completions", json={**CHAT, **fields})


def prompt_of(fake: FakeBackend, tokenizer: Tokenizer) -> str:
    return tokenizer.decode(fake.seen[-1].prompt_token_ids, skip_special_tokens=False)


def stream_chunks(response: httpx.Response) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    lines = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_tools_are_a_400_no_backend_sees(
    client: httpx.AsyncClient, fake: FakeBackend, case: str
) -> None:
    fields, param = BAD[case]
    for stream in (False, True):
        assert_openai_error(await chat(client, stream=stream, **fields), 400, param, None)
    assert fake.seen == []


async def test_a_schema_that_cannot_compile_is_a_400_under_auto_too(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    broken = tool({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}})
    response = await chat(client, tools=[broken])
    assert response.status_code == 400, response.text
    assert fake.seen == []


async def test_tools_reach_the_prompt_through_the_shipped_template(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    assert (await chat(client)).status_code == 200
    prompt = prompt_of(fake, tokenizer)
    assert "<tools>" in prompt and "<tool_call>" in prompt
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].splitlines()
    assert [json.loads(line) for line in listed] == [F["function"], WEATHER["function"]]
    assert prompt.endswith("<|im_start|>user\nAdd one to 1.<|im_end|>\n<|im_start|>assistant\n")
    assert fake.seen[-1].sampling.grammar is None  # auto: the model may answer or call

    assert (await chat(client, tools=None)).status_code == 200
    assert "<tools>" not in prompt_of(fake, tokenizer)


async def test_tool_choice_none_hides_the_tools_and_masks_the_marker(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    response = await chat(client, tool_choice="none")
    assert response.status_code == 200, response.text
    assert "<tools>" not in prompt_of(fake, tokenizer)
    sent = fake.seen[-1].sampling.grammar
    assert sent == JSON_FORM.grammar(ToolSet((Tool("f", F_PARAMETERS),), ToolChoice(ToolChoiceMode.NONE)))
    assert sent is not None and sent.kind is GrammarKind.LARK and "<tool_call>" in sent.text
    choice = response.json()["choices"][0]  # what came back is text: no call is parsed under none
    assert choice["message"]["content"] == CALL_TEXT and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("tool_choice", "parallel", "names"),
    [
        ("required", True, ["f", "get_weather"]),
        ("required", False, ["f", "get_weather"]),
        ({"type": "function", "function": {"name": "get_weather"}}, True, ["get_weather"]),
    ],
)
async def test_forced_choices_send_a_lark_grammar_of_the_offered_calls(
    client: httpx.AsyncClient, fake: FakeBackend, tool_choice: Any, parallel: bool, names: list[str]
) -> None:
    response = await chat(client, tool_choice=tool_choice, parallel_tool_calls=parallel)
    assert response.status_code == 200, response.text
    grammar = fake.seen[-1].sampling.grammar
    assert grammar is not None and grammar.kind is GrammarKind.LARK
    assert grammar.text.startswith("start: calls")
    assert [name for name in ("f", "get_weather") if f'"const": "{name}"' in grammar.text] == names
    assert ('("\\n" call)*' in grammar.text) is parallel


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
async def test_a_call_streams_as_index_id_name_then_argument_fragments(
    client: httpx.AsyncClient, tool_choice: str
) -> None:
    chunks = stream_chunks(await chat(client, tool_choice=tool_choice, stream=True))
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert [set(delta) for delta in deltas[1:-1]] == [{"tool_calls"}] * (len(deltas) - 2)
    assert deltas[-1] == {}  # the finish chunk's
    calls = [delta["tool_calls"] for delta in deltas[1:-1]]
    assert all(len(call) == 1 for call in calls)
    first, rest = calls[0][0], [call[0] for call in calls[1:]]
    assert first["index"] == 0 and first["id"].startswith("call_") and first["type"] == "function"
    assert first["function"] == {"name": "f", "arguments": ""}
    assert rest and all(set(part) == {"index", "function"} and part["index"] == 0 for part in rest)
    arguments = "".join(part["function"]["arguments"] for part in rest)
    assert json.loads(arguments) == {"a": 1}
    if tool_choice == "required":  # forced: the arguments stream as the tokens come
        assert len(rest) > 1
    assert not any(delta.get("content") for delta in deltas)
    finishes = [chunk["choices"][0]["finish_reason"] for chunk in chunks if chunk["choices"]]
    assert finishes[-1] == "tool_calls" and set(finishes[:-1]) == {None}


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
async def test_a_call_comes_back_as_message_tool_calls_with_content_null(
    client: httpx.AsyncClient, tool_choice: str
) -> None:
    response = await chat(client, tool_choice=tool_choice)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"] == "f"
    assert json.loads(call["function"]["arguments"]) == {"a": 1}


async def test_text_before_a_call_and_an_invalid_call_in_auto(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([tokenizer.encode("Let me add.\n" + CALL_TEXT)])
    message = (await chat(client)).json()["choices"][0]["message"]
    assert message["content"] == "Let me add.\n" and len(message["tool_calls"]) == 1

    invalid = CALL_TEXT.replace('"a":1', '"a":"one"')  # fails the schema: text, verbatim
    fake.script = scripted([tokenizer.encode(invalid)])
    for stream in (False, True):
        response = await chat(client, stream=stream)
        if stream:
            deltas = [chunk["choices"][0]["delta"] for chunk in stream_chunks(response) if chunk["choices"]]
            assert "".join(d.get("content", "") for d in deltas) == invalid
            assert not any("tool_calls" in d for d in deltas)
        else:
            choice = response.json()["choices"][0]
            assert choice["message"]["content"] == invalid and "tool_calls" not in choice["message"]
            assert choice["finish_reason"] == "stop"


async def test_a_tool_result_round_trip_reaches_the_prompt(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([tokenizer.encode("It is 2.")])
    messages = [*USER, ASSISTANT_CALL, {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    response = await chat(client, messages=messages)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "It is 2." and choice["finish_reason"] == "stop"
    prompt = prompt_of(fake, tokenizer)
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call><|im_end|>'
        in prompt
    )
    assert (
        "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in prompt
    )


async def test_a_tool_history_reaches_the_prompt_without_active_tools(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    """The model's own template would drop the call and the result: the tool-aware one renders them."""
    fake.script = scripted([tokenizer.encode("It is 2.")])
    messages = [*USER, ASSISTANT_CALL, {"role": "tool", "tool_call_id": "call_1", "content": "2"}]
    for fields in ({"tool_choice": "none"}, {"tools": None}):
        assert (await chat(client, messages=messages, **fields)).status_code == 200
        prompt = prompt_of(fake, tokenizer)
        assert '{"name": "f", "arguments": {"a": 1}}' in prompt and "<tool_response>\n2\n" in prompt
