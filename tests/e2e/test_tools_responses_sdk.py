"""Responses function calling through the official openai SDK, strict and without retries, on SmolLM2
through the running stack (issue 24): a forced call streamed with `responses.stream`, its arguments valid
for the tool's schema because the engine's grammar allowed nothing else, then answered with a
`function_call_output` item through `previous_response_id`."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import RunningStack

pytestmark = pytest.mark.model

MAX_CALL_TOKENS = 80  # the call below is ~25 tokens; room for the model's choice of city
MAX_ANSWER_TOKENS = 200
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 40}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
ASK = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def client(stack: RunningStack) -> OpenAI:
    return OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    name = client.models.list().data[0].id
    # One token of a forced call first: a cold worker's first steps (and its first tool grammar) can pass
    # the 2 s step timeout on a loaded CPU; one token has no next step to time out.
    client.responses.create(
        model=name, input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=1
    )
    return name


def test_a_streamed_function_call_answered_through_previous_response_id(client: OpenAI, model: str) -> None:
    with client.responses.stream(
        model=model,
        input=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=MAX_CALL_TOKENS,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        response = stream.get_final_response()
    assert response.status == "completed", response
    [call] = response.output
    assert call.type == "function_call" and call.status == "completed"
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    assert call.parsed_arguments == arguments  # the SDK parses a strict tool's arguments
    for kind in (
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert kind in kinds, kinds
    assert kinds[-1] == "response.completed"

    answer = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": json.dumps({"city": arguments["city"], "sky": "sunny", "temperature_c": 21}),
    }
    follow_up = client.responses.create(
        model=model,
        previous_response_id=response.id,
        input=[answer],
        max_output_tokens=MAX_ANSWER_TOKENS,
        temperature=0,
    )
    assert follow_up.status == "completed", follow_up
    assert follow_up.previous_response_id == response.id
    assert [item.type for item in follow_up.output] == ["message"]
    assert follow_up.output_text.strip()


def test_an_answer_to_an_unknown_call_is_400(client: OpenAI, model: str) -> None:
    answer = {"type": "function_call_output", "call_id": "call_nobody_made", "output": "sunny"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model, input=[answer], tools=[WEATHER], max_output_tokens=8)
    assert caught.value.status_code == 400 and caught.value.param == "input[0].call_id"
