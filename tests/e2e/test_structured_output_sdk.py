"""Structured output through the official SDKs, strict and without retries, on SmolLM2 through the running
stack (issue 23): OpenAI's `chat.completions.parse` and `responses.parse` with a pydantic model,
`response_format` json_object, and Anthropic's `messages.parse` with `output_format`, streamed and not.
What comes back parses into the model because the engine masked every token it could not take."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated

import anthropic
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.e2e.conftest import RunningStack

pytestmark = pytest.mark.model

MAX_TOKENS = 80  # the person below spelled compactly is ~30 tokens; room for the model's choices


class Colour(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Person(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=12)]
    age: int
    likes_cats: bool
    favourite_colour: Colour


class Pet(BaseModel):
    """For Anthropic: its SDK moves constraints its API does not take (string lengths, number ranges) into
    the description before sending the schema, so they cannot be enforced; its schema subset is used."""

    name: str
    age: int
    likes_cats: bool
    favourite_colour: Colour


ASK = [
    {
        "role": "user",
        "content": "Invent a person. Reply with their name, age, whether they like cats and colour.",
    }
]


@pytest.fixture(scope="module")
def openai_client(stack: RunningStack) -> OpenAI:
    return OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def anthropic_client(stack: RunningStack) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=stack.base_url, api_key="unused", max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def model(openai_client: OpenAI) -> str:
    return openai_client.models.list().data[0].id


def test_chat_completions_parse(openai_client: OpenAI, model: str) -> None:
    reply = openai_client.chat.completions.parse(
        model=model, messages=ASK, response_format=Person, max_tokens=MAX_TOKENS, temperature=0.7, seed=1
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Person)


def test_chat_completions_stream_parse(openai_client: OpenAI, model: str) -> None:
    with openai_client.chat.completions.stream(
        model=model, messages=ASK, response_format=Person, max_tokens=MAX_TOKENS, temperature=0.7, seed=2
    ) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"
    assert isinstance(final.choices[0].message.parsed, Person)


def test_json_object(openai_client: OpenAI, model: str) -> None:
    reply = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object about Paris."}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content or ""), dict)
    else:  # cut by max_tokens inside the object: reported as length, never as a complete object
        assert choice.finish_reason == "length"
        assert (choice.message.content or "").startswith("{")


@pytest.mark.parametrize("stream", [False, True])
def test_responses_parse(openai_client: OpenAI, model: str, stream: bool) -> None:
    kwargs = {
        "model": model,
        "input": ASK[0]["content"],
        "text_format": Person,
        "max_output_tokens": MAX_TOKENS,
    }
    if stream:
        with openai_client.responses.stream(**kwargs) as events:
            response = events.get_final_response()
    else:
        response = openai_client.responses.parse(**kwargs)
    assert response.status == "completed", response
    assert isinstance(response.output_parsed, Person)
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_messages_parse(anthropic_client: anthropic.Anthropic, model: str, stream: bool) -> None:
    kwargs = {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "messages": ASK,
        "output_format": Pet,
        "extra_body": {"temperature": 0},  # this SDK's parse and stream take no temperature of their own
    }
    if stream:
        with anthropic_client.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = anthropic_client.messages.parse(**kwargs)
    assert message.stop_reason == "end_turn", message
    assert isinstance(message.parsed_output, Pet)
