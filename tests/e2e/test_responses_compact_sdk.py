"""`/v1/responses/compact` through the strict openai SDK on the running stack and the real model: ten
stored turns chained by previous_response_id fold into one compaction item, and the next question sent
after that window costs fewer input tokens than the same question continuing the whole history."""

from __future__ import annotations

from typing import Any

import pytest
from openai import OpenAI

from tests.e2e.conftest import RunningStack

pytestmark = pytest.mark.model

ROOM = 48
QUESTIONS = [
    "What is the capital of France?",
    "What is the capital of Germany?",
    "What is the capital of Italy?",
    "What is the capital of Spain?",
    "What is the capital of Japan?",
    "What is the largest planet in the solar system?",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "What is two plus two?",
    "Who wrote Romeo and Juliet?",
]
NEXT = "Which of those capitals did I ask about first?"


@pytest.fixture(scope="module")
def client(stack: RunningStack) -> OpenAI:
    return OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )


@pytest.fixture(scope="module")
def model(client: OpenAI) -> str:
    return client.models.list().data[0].id


def test_ten_turns_compact_and_the_next_turn_costs_fewer_input_tokens(client: OpenAI, model: str) -> None:
    previous_id: str | None = None
    for question in QUESTIONS:
        turn = client.responses.create(
            model=model,
            input=question,
            previous_response_id=previous_id,
            store=True,
            temperature=0,
            max_output_tokens=ROOM,
        )
        assert turn.output_text and turn.usage is not None
        previous_id = turn.id
    assert previous_id is not None

    compacted = client.responses.compact(model=model, previous_response_id=previous_id)
    assert compacted.object == "response.compaction"
    [item] = compacted.output
    assert item.type == "compaction" and item.encrypted_content.startswith("kvc1.")
    assert compacted.usage.input_tokens > 0 and compacted.usage.output_tokens > 0

    window: list[Any] = [entry.model_dump(exclude_none=True) for entry in compacted.output]  # SDK params
    after_window = client.responses.create(
        model=model,
        input=[*window, {"role": "user", "content": NEXT}],
        store=False,
        temperature=0,
        max_output_tokens=ROOM,
    )
    eleventh = client.responses.create(
        model=model,
        input=NEXT,
        previous_response_id=previous_id,
        store=False,
        temperature=0,
        max_output_tokens=ROOM,
    )
    assert after_window.status in ("completed", "incomplete") and after_window.output_text
    assert after_window.usage is not None and eleventh.usage is not None
    assert after_window.usage.input_tokens < eleventh.usage.input_tokens, (
        after_window.usage.input_tokens,
        eleventh.usage.input_tokens,
    )
