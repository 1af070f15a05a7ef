"""Tool calling through the official OpenAI SDK, strict and without retries, on SmolLM2 through the running
stack (issue 24): `pydantic_function_tool` with tool_choice required and named, streamed through
`chat.completions.stream`, comes back with `parsed_arguments` filled because the engine's grammar forced the
call; tool_choice none gives text; a tool result round trip answers with text."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.e2e.conftest import RunningStack

pytestmark = pytest.mark.model

MAX_TOKENS = 80  # a forced call below is ~35 tokens compact; room for the model's string


class GetWeather(BaseModel):
    """Get the current weather in a city."""

    city: Annotated[str, Field(max_length=16)]
    unit: Literal["celsius", "fahrenheit"]


ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
WEATHER_TOOL = openai.pydantic_function_tool(GetWeather, name="get_weather")


@pytest.fixture(scope="module")
def client(stack: RunningStack) -> OpenAI:
    return OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_a_forced_call_streams_into_parsed_arguments(client: OpenAI, model: str, tool_choice: Any) -> None:
    with client.chat.completions.stream(
        model=model,
        messages=ASK,
        tools=[WEATHER_TOOL],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_tokens=MAX_TOKENS,
        temperature=0.7,
        seed=3,
    ) as stream:
        argument_deltas = [event for event in stream if event.type == "tool_calls.function.arguments.delta"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert not choice.message.content
    [call] = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert isinstance(call.function.parsed_arguments, GetWeather)
    assert len(argument_deltas) > 1  # the arguments came in pieces, as they were generated


def test_tool_choice_none_gives_text(client: OpenAI, model: str) -> None:
    reply = client.chat.completions.create(
        model=model, messages=ASK, tools=[WEATHER_TOOL], tool_choice="none", max_tokens=24, temperature=0
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length")
    assert choice.message.content and not choice.message.tool_calls


def test_a_tool_result_round_trip_answers_with_text(client: OpenAI, model: str) -> None:
    messages: list[Any] = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_weather1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_weather1", "content": '{"temperature": 21, "sky": "sunny"}'},
    ]
    response = client.chat.completions.with_raw_response.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=24, temperature=0
    )  # tool_choice auto: the tool-aware template renders the call and its result
    assert response.http_response.status_code == 200
    choice = response.parse().choices[0]
    assert choice.message.content and not choice.message.tool_calls
