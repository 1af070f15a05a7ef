"""The openai SDK's Responses API, strict and without retries, against the running stack on the real model."""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.e2e.conftest import RunningStack

pytestmark = pytest.mark.model

FRANCE = "What is the capital of France?"
INSTRUCTIONS = "Answer in one short sentence."
ROOM = 48  # enough output tokens for the short greedy answers below to finish


@pytest.fixture(scope="module")
def client(stack: RunningStack) -> OpenAI:
    return OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_create_with_instructions_answers_paris(client: OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model, instructions=INSTRUCTIONS, input=FRANCE, temperature=0, max_output_tokens=ROOM
    )
    assert "Paris" in response.output_text
    assert response.status == "completed" and response.instructions == INSTRUCTIONS
    assert response.usage is not None and response.usage.output_tokens > 0


def test_stream_final_response_equals_create(client: OpenAI, model: str) -> None:
    whole = client.responses.create(model=model, input=FRANCE, temperature=0, max_output_tokens=ROOM)
    with client.responses.stream(model=model, input=FRANCE, temperature=0, max_output_tokens=ROOM) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and "Paris" in final.output_text
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert kinds.count("response.output_text.delta") >= 2


def test_previous_response_id_continues_like_the_whole_chat(client: OpenAI, model: str) -> None:
    first = client.responses.create(model=model, input=FRANCE, temperature=0, max_output_tokens=ROOM)
    follow_up = "And the capital of Germany?"
    second = client.responses.create(
        model=model, previous_response_id=first.id, input=follow_up, temperature=0, max_output_tokens=ROOM
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": FRANCE},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": follow_up},
        ],
        temperature=0,
        max_tokens=ROOM,
    )
    assert "Berlin" in second.output_text and second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens


def test_retrieve_returns_the_stored_response(client: OpenAI, model: str) -> None:
    created = client.responses.create(model=model, input=FRANCE, temperature=0, max_output_tokens=ROOM)
    assert client.responses.retrieve(created.id) == created


def test_max_output_tokens_gives_incomplete(client: OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model, input="Write a long story about a dragon.", temperature=0, max_output_tokens=5
    )
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 5


def test_same_greedy_text_as_chat_completions(client: OpenAI, model: str) -> None:
    response = client.responses.create(
        model=model, instructions=INSTRUCTIONS, input=FRANCE, temperature=0, max_output_tokens=32
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": FRANCE}],
        temperature=0,
        max_tokens=32,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
