"""Anthropic tools and thinking through the official SDK, strict and without retries, on SmolLM2 through the
running stack (issue 24): tool_choice any and tool, streamed with `messages.stream` and its input_json_delta
fragments, the final tool_use input valid for its schema (the engine's grammar made it so); a tool_result
round trip; and `thinking` accepted on a model without a thinking mode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from anthropic.types import MessageParam, ToolParam

from tests.e2e.conftest import TOKEN, RunningStack, wait_http_ready
from tests.stack_helpers import Proc, free_port, stack_env

pytestmark = pytest.mark.model

MAX_TOKENS = 80  # a forced call here is ~25 tokens; room for the model's choices
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER: ToolParam = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": SCHEMA,
}
TIME: ToolParam = {
    "name": "get_time",
    "description": "Get the current time in a time zone.",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 24}}},
}
ASK: list[MessageParam] = [{"role": "user", "content": "What is the weather like in Paris today?"}]
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}  # anthropic 2.14's stream takes no temperature
# Anthropic's rules: a budget of at least 1024 tokens, below max_tokens.
THINKING: dict[str, Any] = {"type": "enabled", "budget_tokens": 1024}
THINKING_MAX_TOKENS = 2048


def sdk_client(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=base_url, api_key="unused", max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def client(stack: RunningStack) -> anthropic.Anthropic:
    return sdk_client(stack.base_url)


@pytest.fixture(scope="module")
def model(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"])


@pytest.fixture(scope="module")
def roomy_client(
    stack: RunningStack, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[anthropic.Anthropic]:
    """A second codec on the stack's router whose limits let max_tokens reach 2048: a thinking budget must
    be at least 1024 and below max_tokens, and the stack's codec keeps the default limit of 1024. Its step
    timeout is generous, as this codec only serves these few requests on a busy test machine."""
    port = free_port()
    step_timeout_ms = 10_000
    env = stack_env(
        TOKEN,
        KVRELAY_MODEL__DTYPE="float32",
        KVRELAY_LIMITS__MAX_OUTPUT_TOKENS=str(THINKING_MAX_TOKENS),
        KVRELAY_LIMITS__STEP_TIMEOUT_MS=str(step_timeout_ms),
        KVRELAY_LIMITS__REQUEST_TIMEOUT_MS=str(step_timeout_ms * THINKING_MAX_TOKENS),
    )
    args = ["codec", "--model", str(model_dir), "--router", stack.router_address, "--port", str(port)]
    codec = Proc(args, env, tmp_path_factory.mktemp("roomy-codec") / "codec.log")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, codec)
        yield sdk_client(url)
    finally:
        codec.stop()


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use_streams_input_json_that_validates(
    client: anthropic.Anthropic, model: str, choice: dict[str, Any]
) -> None:
    fragments: list[str] = []
    with client.messages.stream(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={**choice, "disable_parallel_tool_use": True},  # type: ignore[typeddict-item]
        **GREEDY,
    ) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                fragments.append(event.delta.partial_json)
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use", message
    [block] = [block for block in message.content if block.type == "tool_use"]
    assert block.id.startswith("toolu_")
    if choice["type"] == "tool":
        assert block.name == "get_weather"
    schema = SCHEMA if block.name == "get_weather" else TIME["input_schema"]
    jsonschema.validate(block.input, schema)
    assert fragments and json.loads("".join(fragments)) == block.input


def test_tool_result_round_trip_answers_in_text(client: anthropic.Anthropic, model: str) -> None:
    first = client.messages.create(
        model=model,
        max_tokens=MAX_TOKENS,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
        **GREEDY,
    )
    assert first.stop_reason == "tool_use", first
    [call] = [block for block in first.content if block.type == "tool_use"]
    jsonschema.validate(call.input, SCHEMA)
    history: list[MessageParam] = [
        *ASK,
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": call.id,
                    "content": [{"type": "text", "text": "Sunny, 24 degrees celsius."}],
                }
            ],
        },
    ]
    second = client.messages.create(
        model=model,
        max_tokens=40,
        messages=history,
        tools=[WEATHER],
        tool_choice={"type": "none"},  # the answer in text, not another call
        **GREEDY,
    )
    assert second.stop_reason in ("end_turn", "max_tokens"), second
    assert [block.type for block in second.content] == ["text"]
    assert second.content[0].text.strip()  # type: ignore[union-attr]
    counted = client.messages.count_tokens(
        model=model, messages=history, tools=[WEATHER], tool_choice={"type": "none"}
    )
    usage = second.usage
    assert counted.input_tokens == usage.input_tokens + (usage.cache_read_input_tokens or 0)


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_is_accepted_on_a_model_without_a_thinking_mode(
    roomy_client: anthropic.Anthropic, model: str, stream: bool
) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": THINKING_MAX_TOKENS,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "thinking": THINKING,
        "stop_sequences": ["."],  # one sentence is enough
        **GREEDY,
    }
    if stream:
        with roomy_client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = roomy_client.messages.create(**kwargs)
    assert message.stop_reason in ("end_turn", "stop_sequence"), message
    assert [block.type for block in message.content] == ["text"]  # SmolLM2 does not think: no thinking block
    assert message.content[0].text.strip()  # type: ignore[union-attr]
