"""Anthropic Messages tools and thinking at the codec (issue 24), over a fake backend: tool_use blocks and
`stop_reason: tool_use`, the streamed tool_use block with input_json_delta fragments, tool_use and
tool_result history in the prompt, `thinking` accepted and ignored on SmolLM2 and split into thinking
blocks on a template with a thinking mode, and each bad input a 400 in Anthropic's shape that no backend
sees. What the stream sends is also replayed through the anthropic SDK's strict stream helpers."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import pytest

from services.codec.protocols.anthropic_messages import tool_input
from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, LimitsConfig, ModelConfig
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

pytestmark = pytest.mark.model

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER_SCHEMA}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
BODY: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": 64, "messages": ASK, "tools": [WEATHER, TIME]}
CALL_INPUT = {"city": "Paris", "unit": "celsius"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(CALL_INPUT) + "}\n</tool_call>"
TOOLU = re.compile(r"^toolu_[0-9a-f]{24}$")
LIMITS = LimitsConfig(max_output_tokens=2048, request_timeout_ms=5_000_000)  # room for a thinking budget

# A ChatML template with a Qwen3-style thinking mode: the prompt opens `<think>` unless thinking is off.
THINKING_TEMPLATE = """\
{%- for message in messages -%}
{{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- "<|im_start|>assistant\\n" -}}
{%- if enable_thinking is defined and not enable_thinking -%}{{- "<think>\\n\\n</think>\\n\\n" -}}
{%- else -%}{{- "<think>\\n" -}}{%- endif -%}
{%- endif -%}
"""


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path) -> FakeBackend:
    return FakeBackend(identity_for(model_dir).tokenizer_fingerprint, max_model_len=4096)


@pytest.fixture
async def client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(tokenizer, fake, identity_for(model_dir), KvrelayConfig(limits=LIMITS))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


@pytest.fixture
async def thinking_client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend, tmp_path: Path
) -> AsyncIterator[httpx.AsyncClient]:
    template = tmp_path / "think.jinja"
    template.write_text(THINKING_TEMPLATE, encoding="utf-8")
    config = KvrelayConfig(model=ModelConfig(chat_template=str(template)), limits=LIMITS)
    app = make_app(tokenizer, fake, identity_for(model_dir), config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


def play(fake: FakeBackend, tokenizer: Tokenizer, text: str, finish_reason: str = "stop") -> None:
    fake.script = scripted([tokenizer.encode(text)], finish_reason)


def events_of(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The SSE body as (event name, data) pairs, each name checked against its data's type."""
    events = []
    for chunk in text.strip().split("\n\n"):
        name_line, data_line = chunk.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def replay(body: str) -> anthropic.types.Message:
    """The final message the anthropic SDK's strict stream helpers build from `body`."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body.encode())

    client = anthropic.Anthropic(
        base_url="http://replay",
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )
    with client.messages.stream(model=MODEL_NAME, max_tokens=64, messages=ASK) as stream:  # type: ignore[arg-type]
        return stream.get_final_message()


def shape(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Each event's name, with a block's index and type (starts) or delta type (deltas)."""
    out = []
    for name, data in events:
        if name == "content_block_start":
            out.append(f"start {data['index']} {data['content_block']['type']}")
        elif name == "content_block_delta":
            out.append(f"delta {data['index']} {data['delta']['type']}")
        elif name == "content_block_stop":
            out.append(f"stop {data['index']}")
        else:
            out.append(name)
    return out


def squash(items: list[str]) -> list[str]:
    """Runs of the same item as one (the number of deltas depends on the tokenizer)."""
    return [item for n, item in enumerate(items) if n == 0 or items[n - 1] != item]


def prompt_of(fake: FakeBackend, tokenizer: Tokenizer) -> str:
    return tokenizer.decode(fake.seen[-1].prompt_token_ids, skip_special_tokens=False)


# ---- replies with calls ----


@pytest.mark.parametrize(
    "choice", [None, {"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}]
)
async def test_a_call_is_a_tool_use_block_with_stop_reason_tool_use(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, choice: dict[str, Any] | None
) -> None:
    play(fake, tokenizer, CALL)
    body = BODY if choice is None else {**BODY, "tool_choice": choice}
    response = await client.post("/v1/messages", json=body)
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None
    [block] = message["content"]
    assert set(block) == {"type", "id", "name", "input"}
    assert (block["type"], block["name"], block["input"]) == ("tool_use", "get_weather", CALL_INPUT)
    assert TOOLU.match(block["id"]), block["id"]
    grammar = fake.seen[-1].sampling.grammar
    forced = choice is not None and choice["type"] != "auto"
    assert (grammar is not None) == forced  # any / tool force a call through the grammar; auto does not
    if choice is not None and choice["type"] == "tool":
        assert '"const": "get_weather"' in grammar.text and "get_time" not in grammar.text  # type: ignore[union-attr]
    assert "get_weather" in prompt_of(fake, tokenizer)  # the tools reach the prompt


async def test_disable_parallel_tool_use_allows_one_call_only(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    play(fake, tokenizer, CALL)
    for disable in (False, True):
        choice = {"type": "any", "disable_parallel_tool_use": disable}
        response = await client.post("/v1/messages", json={**BODY, "tool_choice": choice})
        assert response.status_code == 200, response.text
        grammar = fake.seen[-1].sampling.grammar
        assert grammar is not None and ('("\\n" call)*' in grammar.text) is not disable


async def test_text_before_a_call_is_a_text_block_first(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    play(fake, tokenizer, "Let me check. " + CALL)
    message = (await client.post("/v1/messages", json=BODY)).json()
    assert [block["type"] for block in message["content"]] == ["text", "tool_use"]
    assert message["content"][0]["text"] == "Let me check. "
    assert message["content"][1]["input"] == CALL_INPUT and message["stop_reason"] == "tool_use"
    response = await client.post("/v1/messages", json={**BODY, "stream": True})
    events = events_of(response.text)
    assert squash(shape(events)) == [
        "message_start",
        "ping",
        "start 0 text",
        "delta 0 text_delta",
        "stop 0",
        "start 1 tool_use",
        "delta 1 input_json_delta",
        "stop 1",
        "message_delta",
        "message_stop",
    ]
    final = replay(response.text)
    assert [block.type for block in final.content] == ["text", "tool_use"]
    assert final.content[1].input == CALL_INPUT  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "choice", [{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "get_weather"}]
)
async def test_streamed_tool_use_sends_input_json_fragments_that_join_into_the_input(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, choice: dict[str, Any]
) -> None:
    play(fake, tokenizer, CALL)
    response = await client.post("/v1/messages", json={**BODY, "tool_choice": choice, "stream": True})
    assert response.status_code == 200, response.text
    events = events_of(response.text)
    assert squash(shape(events)) == [
        "message_start",
        "ping",
        "start 0 tool_use",
        "delta 0 input_json_delta",
        "stop 0",
        "message_delta",
        "message_stop",
    ]
    start = next(data for name, data in events if name == "content_block_start")["content_block"]
    assert (start["name"], start["input"]) == ("get_weather", {})
    assert TOOLU.match(start["id"]), start["id"]
    fragments = [data["delta"]["partial_json"] for name, data in events if name == "content_block_delta"]
    assert json.loads("".join(fragments)) == CALL_INPUT
    if choice["type"] != "auto":  # a forced call streams as it comes; an auto one is checked whole first
        assert len(fragments) > 1
    delta = next(data for name, data in events if name == "message_delta")["delta"]
    assert delta == {"stop_reason": "tool_use", "stop_sequence": None}
    final = replay(response.text)
    assert final.stop_reason == "tool_use"
    [block] = final.content
    assert block.type == "tool_use" and block.id == start["id"] and block.input == CALL_INPUT


async def test_a_call_cut_by_max_tokens_keeps_the_input_it_had(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    play(
        fake,
        tokenizer,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "cel',
        "length",
    )
    body = {**BODY, "tool_choice": {"type": "any"}}
    message = (await client.post("/v1/messages", json=body)).json()
    assert message["stop_reason"] == "max_tokens"
    [block] = message["content"]
    assert block["type"] == "tool_use" and block["input"] == {"city": "Paris"}
    response = await client.post("/v1/messages", json={**body, "stream": True})
    final = replay(response.text)
    assert final.stop_reason == "max_tokens" and final.content[0].type == "tool_use"


def test_tool_input_of_cut_arguments() -> None:
    assert tool_input('{"a": 1, "b": [1, 2') == {"a": 1, "b": [1, 2]}
    assert tool_input('{"a": {"b": "x"}, "c": tr') == {"a": {"b": "x"}}
    assert tool_input('{"a": "unterminated') == {}
    assert tool_input("") == {} and tool_input("[1]") == {}


async def test_a_reply_in_text_has_one_text_block_and_end_turn(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    play(fake, tokenizer, "It is sunny.")
    message = (await client.post("/v1/messages", json=BODY)).json()
    assert message["content"] == [{"type": "text", "text": "It is sunny."}]
    assert message["stop_reason"] == "end_turn"
    response = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert squash(shape(events_of(response.text))) == [
        "message_start",
        "ping",
        "start 0 text",
        "delta 0 text_delta",
        "stop 0",
        "message_delta",
        "message_stop",
    ]


async def test_an_empty_reply_still_has_a_text_block(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([[]])
    message = (await client.post("/v1/messages", json=BODY)).json()
    assert message["content"] == [{"type": "text", "text": ""}]
    response = await client.post("/v1/messages", json={**BODY, "stream": True})
    assert shape(events_of(response.text)) == [
        "message_start",
        "ping",
        "start 0 text",
        "stop 0",
        "message_delta",
        "message_stop",
    ]
    assert replay(response.text).content[0].type == "text"


async def test_tool_choice_none_keeps_tools_out_and_masks_the_marker(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    play(fake, tokenizer, "It is sunny.")
    response = await client.post("/v1/messages", json={**BODY, "tool_choice": {"type": "none"}})
    assert response.status_code == 200, response.text
    assert "get_weather" not in prompt_of(fake, tokenizer)
    grammar = fake.seen[-1].sampling.grammar
    assert grammar is not None and "tool_call" in grammar.text
    assert response.json()["content"] == [{"type": "text", "text": "It is sunny."}]


# ---- history ----


async def test_tool_use_and_tool_result_history_reach_the_prompt(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    play(fake, tokenizer, "Sunny in Paris, rainy in Oslo.")
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "SECRET THOUGHT", "signature": "sig"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_2",
                    "content": [{"type": "text", "text": "rain"}, {"type": "text", "text": "wind"}],
                },
                {"type": "text", "text": "Summarise."},
            ],
        },
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_3", "name": "get_time", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_3", "content": "no clock", "is_error": True},
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"temp": 21}]},
            ],
        },
    ]
    response = await client.post("/v1/messages", json={**BODY, "messages": messages})
    assert response.status_code == 200, response.text
    assert response.json()["content"] == [{"type": "text", "text": "Sunny in Paris, rainy in Oslo."}]
    prompt = prompt_of(fake, tokenizer)
    assert "SECRET THOUGHT" not in prompt  # earlier thinking is dropped
    assert (
        "<|im_start|>assistant\nChecking.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nrain\nwind\n</tool_response><|im_end|>\n"
        "<|im_start|>user\nSummarise.<|im_end|>\n"
    ) in prompt
    assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in prompt
    assert (
        "<tool_response>\nError: no clock\n</tool_response>\n"
        '<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    ) in prompt
    counted = await client.post(
        "/v1/messages/count_tokens",
        json={k: v for k, v in BODY.items() if k != "max_tokens"} | {"messages": messages},
    )
    assert counted.json() == {"input_tokens": len(fake.seen[-1].prompt_token_ids)}


@pytest.mark.parametrize("tools", [{"tool_choice": {"type": "none"}}, {"tools": []}])
async def test_tool_history_reaches_the_prompt_when_no_call_may_follow(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, tools: dict[str, Any]
) -> None:
    """The tool-aware template shows the calls and results even when no tool may be called now."""
    play(fake, tokenizer, "Sunny.")
    messages = [
        *ASK,
        {"role": "assistant", "content": [USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    response = await client.post("/v1/messages", json={**BODY, "messages": messages, **tools})
    assert response.status_code == 200, response.text
    prompt = prompt_of(fake, tokenizer)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


async def test_count_tokens_counts_the_tools(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    play(fake, tokenizer, CALL)
    count = {k: v for k, v in BODY.items() if k != "max_tokens"}
    with_tools = (await client.post("/v1/messages/count_tokens", json=count)).json()["input_tokens"]
    without = (await client.post("/v1/messages/count_tokens", json={**count, "tools": []})).json()
    await client.post("/v1/messages", json=BODY)
    assert with_tools == len(fake.seen[-1].prompt_token_ids) > without["input_tokens"]


async def test_a_final_assistant_text_is_still_a_prefill_with_tools(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    play(fake, tokenizer, " sunny.")
    messages = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "It is"}]}]
    message = (await client.post("/v1/messages", json={**BODY, "messages": messages})).json()
    assert message["content"] == [{"type": "text", "text": " sunny."}]
    assert prompt_of(fake, tokenizer).endswith("<|im_start|>assistant\nIt is")


# ---- thinking ----


@pytest.mark.parametrize(
    "thinking",
    [{"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}, {"type": "disabled"}],
)
async def test_thinking_is_accepted_and_ignored_on_a_model_without_a_thinking_mode(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, thinking: dict[str, Any]
) -> None:
    play(fake, tokenizer, "Hello")
    plain = {"model": MODEL_NAME, "max_tokens": 2048, "messages": ASK}
    await client.post("/v1/messages", json=plain)
    expected_prompt = fake.seen[-1].prompt_token_ids
    for stream in (False, True):
        response = await client.post("/v1/messages", json={**plain, "thinking": thinking, "stream": stream})
        assert response.status_code == 200, response.text
        seen = fake.seen[-1]
        assert seen.prompt_token_ids == expected_prompt and seen.sampling.grammar is None
        message = replay(response.text) if stream else anthropic.types.Message.model_validate(response.json())
        assert [(block.type, block.text) for block in message.content] == [("text", "Hello")]  # type: ignore[union-attr]
    counted = await client.post(
        "/v1/messages/count_tokens", json={"model": MODEL_NAME, "messages": ASK, "thinking": thinking}
    )
    assert counted.json() == {"input_tokens": len(expected_prompt)}


async def test_a_thinking_template_gives_thinking_blocks_before_the_answer(
    thinking_client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    play(fake, tokenizer, "The user greets me.</think>\n\nHello there")
    body = {
        "model": MODEL_NAME,
        "max_tokens": 2048,
        "messages": ASK,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    message = (await thinking_client.post("/v1/messages", json=body)).json()
    assert message["content"] == [
        {"type": "thinking", "thinking": "The user greets me.", "signature": ""},
        {"type": "text", "text": "Hello there"},
    ]
    assert prompt_of(fake, tokenizer).endswith("<|im_start|>assistant\n<think>\n")
    grammar = fake.seen[-1].sampling.grammar
    assert grammar is not None and "max_tokens=1024" in grammar.text  # the budget, enforced by the engine
    response = await thinking_client.post("/v1/messages", json={**body, "stream": True})
    events = events_of(response.text)
    assert squash(shape(events)) == [
        "message_start",
        "ping",
        "start 0 thinking",
        "delta 0 thinking_delta",
        "delta 0 signature_delta",
        "stop 0",
        "start 1 text",
        "delta 1 text_delta",
        "stop 1",
        "message_delta",
        "message_stop",
    ]
    start = next(data for name, data in events if name == "content_block_start")["content_block"]
    assert start == {"type": "thinking", "thinking": "", "signature": ""}
    final = replay(response.text)
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "The user greets me."  # type: ignore[union-attr]
    # Without `thinking`, as on Anthropic's API, the model does not think.
    await thinking_client.post("/v1/messages", json={k: v for k, v in body.items() if k != "thinking"})
    assert prompt_of(fake, tokenizer).endswith("<think>\n\n</think>\n\n")


# ---- bad input ----

USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
# (the body's changes, a text the error message must contain)
BAD: dict[str, tuple[dict[str, Any], str]] = {
    "input_schema not an object schema": (
        {"tools": [{"name": "f", "input_schema": {"type": "string"}}]},
        "tools[0].input_schema",
    ),
    "input_schema not an object": ({"tools": [{"name": "f", "input_schema": "{}"}]}, "tools[0].input_schema"),
    "input_schema missing": ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    "schema does not compile": (
        {
            "tools": [
                {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
            ]
        },
        "tools[0]",
    ),
    "bad tool name": (
        {"tools": [{"name": "no spaces", "input_schema": {"type": "object"}}]},
        "tools[0].name",
    ),
    "two tools of one name": ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    "server tool": (
        {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]},
        "web_search_20250305 tools are not supported",
    ),
    "tool_choice names a missing tool": ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    "tool_choice tool without a name": ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    "tool_choice any without tools": ({"tools": [], "tool_choice": {"type": "any"}}, "tool_choice"),
    "tool_choice unknown type": ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    "tool_result for an unknown tool_use_id": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}],
                }
            ]
        },
        "messages[0].content[0].tool_use_id",
    ),
    "tool_result answering a later tool_use": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"}],
                },
                {"role": "assistant", "content": [USE]},
                {"role": "user", "content": "go on"},
            ]
        },
        "messages[0].content[0].tool_use_id",
    ),
    "tool_use in a user message": (
        {"messages": [{"role": "user", "content": [USE]}]},
        "messages[0].content[0]",
    ),
    "tool_use in the final assistant message": (
        {"messages": [*ASK, {"role": "assistant", "content": [USE]}]},
        "messages[1].content[0]",
    ),
    "tool_use input not an object": (
        {"messages": [*ASK, {"role": "assistant", "content": [{**USE, "input": "{}"}]}, *ASK]},
        "messages[1].content[0].input",
    ),
    "image in a tool_result": (
        {
            "messages": [
                *ASK,
                {"role": "assistant", "content": [USE]},
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}],
                        }
                    ],
                },
            ]
        },
        "image content blocks are not supported",
    ),
    "thinking with tool_choice any": (
        {"tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        "tool_choice",
    ),
    "adaptive thinking with tool_choice tool": (
        {"tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {"type": "adaptive"}},
        "tool_choice",
    ),
    "thinking budget under 1024": ({"thinking": {"type": "enabled", "budget_tokens": 512}}, "budget_tokens"),
    "thinking budget not under max_tokens": (
        {"max_tokens": 1024, "thinking": {"type": "enabled", "budget_tokens": 1024}},
        "budget_tokens",
    ),
    "thinking enabled without a budget": ({"thinking": {"type": "enabled"}}, "budget_tokens"),
    "budget on disabled thinking": (
        {"thinking": {"type": "disabled", "budget_tokens": 2048}},
        "budget_tokens",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_bad_tool_or_thinking_input_is_a_400_no_backend_sees(
    client: httpx.AsyncClient, fake: FakeBackend, case: str
) -> None:
    changes, text = BAD[case]
    body = {**BODY, "max_tokens": 2048, **changes}
    for stream in (False, True):
        response = await client.post("/v1/messages", json={**body, "stream": stream})
        assert response.status_code == 400, response.text
        error = response.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
        assert text in error["error"]["message"], error
    count = {k: v for k, v in body.items() if k not in ("max_tokens", "stream")}
    if "max_tokens" not in text and "not under max_tokens" not in case:  # count_tokens has no max_tokens
        response = await client.post("/v1/messages/count_tokens", json=count)
        assert response.status_code == 400, response.text
        assert text in response.json()["error"]["message"]
    assert fake.seen == []
