"""The official anthropic SDK, strict and without retries, against the running stack on the real model."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import MessageParam
from openai import OpenAI

from tests.e2e.conftest import RunningStack

pytestmark = pytest.mark.model

SYSTEM = "You are a helpful assistant. Answer briefly."
QUESTION = "What is the capital of France?"
FRANCE: list[MessageParam] = [{"role": "user", "content": QUESTION}]
GREEDY: dict[str, Any] = {"extra_body": {"temperature": 0}}  # anthropic 2.14 has no temperature argument


@pytest.fixture(scope="module")
def client(stack: RunningStack) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=stack.base_url, api_key="unused", max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def model(stack: RunningStack) -> str:
    return str(httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"])


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_create_with_system_prompt_answers_paris(client: anthropic.Anthropic, model: str) -> None:
    message = client.messages.create(model=model, max_tokens=24, system=SYSTEM, messages=FRANCE, **GREEDY)
    assert "Paris" in text_of(message)
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_stream_final_message_equals_create(client: anthropic.Anthropic, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 24,
        "system": SYSTEM,
        "messages": FRANCE,
        **GREEDY,
    }
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()
    assert text_of(final) == text_of(whole) and "Paris" in text_of(final)
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequence_cuts_the_text(client: anthropic.Anthropic, model: str) -> None:
    message = client.messages.create(
        model=model, max_tokens=24, messages=FRANCE, stop_sequences=["Paris"], **GREEDY
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "Paris")
    assert "Paris" not in text_of(message) and text_of(message).strip()


def test_max_tokens_gives_stop_reason_max_tokens(client: anthropic.Anthropic, model: str) -> None:
    message = client.messages.create(model=model, max_tokens=3, messages=FRANCE, **GREEDY)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 3)


def test_count_tokens_equals_the_prompt_of_create(client: anthropic.Anthropic, model: str) -> None:
    message = client.messages.create(model=model, max_tokens=4, system=SYSTEM, messages=FRANCE, **GREEDY)
    counted = client.messages.count_tokens(model=model, system=SYSTEM, messages=FRANCE)
    usage = message.usage
    total = (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    )
    assert counted.input_tokens == total


def test_greedy_messages_equal_greedy_chat_completions(
    client: anthropic.Anthropic, model: str, stack: RunningStack
) -> None:
    message = client.messages.create(model=model, max_tokens=32, system=SYSTEM, messages=FRANCE, **GREEDY)
    openai_client = OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )
    chat = openai_client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=32,
    )
    assert text_of(message) == chat.choices[0].message.content
    assert chat.usage is not None
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == chat.usage.prompt_tokens


def test_unknown_model_raises_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=4, messages=FRANCE)
