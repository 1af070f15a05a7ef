"""The official openai SDK, strict and without retries, against `/v1/responses` on uvicorn over a fake
backend: create, stream, instructions, continuation, retrieve, delete, incomplete and store=false."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest

from services.codec.text.tokenizer import Tokenizer
from services.common.outputs import FinishReason
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted, serve_in_thread

pytestmark = pytest.mark.model

HELLO, WORLD, BANG = 19556, 905, 17  # "Hello", " world", "!" in SmolLM2
UNKNOWN_ID = "resp_" + "0" * 32


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def fake(model_dir: Path) -> FakeBackend:
    return FakeBackend(identity_for(model_dir).tokenizer_fingerprint)


@pytest.fixture(scope="module")
def client(model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend) -> Iterator[openai.OpenAI]:
    """Strict and without retries: a missing field or a retried failure cannot hide."""
    with (
        serve_in_thread(make_app(tokenizer, fake, identity_for(model_dir))) as url,
        openai.OpenAI(
            base_url=f"{url}/v1",
            api_key="x",
            max_retries=0,
            _strict_response_validation=True,
            http_client=httpx2.Client(timeout=30),
        ) as strict_client,
    ):
        yield strict_client


@pytest.fixture(autouse=True)
def hello_world(fake: FakeBackend) -> None:
    fake.reset()
    fake.script = scripted([[HELLO, WORLD, BANG]])


def prompt_text(fake: FakeBackend, tokenizer: Tokenizer, index: int = -1) -> str:
    """What the backend was asked, special tokens included."""
    return tokenizer.decode(fake.seen[index].prompt_token_ids, skip_special_tokens=False)


def test_create_returns_a_completed_response(client: openai.OpenAI, fake: FakeBackend) -> None:
    response = client.responses.create(model=MODEL_NAME, input="hi", metadata={"k": "v"}, user="u1")
    assert response.output_text == "Hello world!"
    assert response.status == "completed"
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.metadata == {"k": "v"} and response.user == "u1"
    assert response.usage is not None
    assert response.usage.output_tokens == 4  # three text tokens and EOS
    assert response.usage.input_tokens_details.cache_write_tokens == 0
    assert response.output[0].type == "message" and response.output[0].status == "completed"


def test_stream_helper_gives_the_final_response(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL_NAME, input="hi", temperature=0) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.output_text == "Hello world!"
    assert final.temperature == 0
    assert client.responses.retrieve(final.id).output_text == "Hello world!"  # streamed ones are stored


def test_instructions_become_the_system_prompt(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    response = client.responses.create(model=MODEL_NAME, instructions="Answer like a pirate.", input="hi")
    assert response.instructions == "Answer like a pirate."
    assert prompt_text(fake, tokenizer).startswith("<|im_start|>system\nAnswer like a pirate.<|im_end|>\n")


def test_previous_response_carries_the_turn_but_not_its_instructions(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    first = client.responses.create(model=MODEL_NAME, instructions="FIRST-RULES", input="What is 2+2?")
    second = client.responses.create(
        model=MODEL_NAME, previous_response_id=first.id, input="And 3+3?", instructions="SECOND-RULES"
    )
    assert second.previous_response_id == first.id
    prompt = prompt_text(fake, tokenizer)
    assert "FIRST-RULES" not in prompt
    expected = (
        "<|im_start|>system\nSECOND-RULES<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\nHello world!<|im_end|>\n<|im_start|>user\nAnd 3+3?<|im_end|>\n"
    )
    assert prompt.startswith(expected)
    third = client.responses.create(model=MODEL_NAME, previous_response_id=second.id, input="And 4+4?")
    prompt = prompt_text(fake, tokenizer)
    assert prompt.count("Hello world!") == 2
    assert "What is 2+2?" in prompt and "And 3+3?" in prompt and "SECOND-RULES" not in prompt
    assert third.usage is not None and third.usage.input_tokens == len(fake.seen[-1].prompt_token_ids)


def test_input_items_carry_assistant_history(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    first = client.responses.create(model=MODEL_NAME, input="hi")
    client.responses.create(
        model=MODEL_NAME,
        input=[
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            *[item.model_dump() for item in first.output],  # the SDK's own output items, sent back
            {"type": "message", "role": "user", "content": "again"},
        ],
    )
    assert prompt_text(fake, tokenizer).startswith(
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nHello world!<|im_end|>\n<|im_start|>user\nagain<|im_end|>\n"
    )


def test_retrieve_then_delete_then_404(client: openai.OpenAI) -> None:
    created = client.responses.create(model=MODEL_NAME, input="hi")
    assert client.responses.retrieve(created.id) == created
    assert client.responses.delete(created.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_unknown_ids_are_404(client: openai.OpenAI, fake: FakeBackend) -> None:
    for bad_id in (UNKNOWN_ID, "not-an-id"):
        with pytest.raises(openai.NotFoundError) as caught:
            client.responses.retrieve(bad_id)
        assert caught.value.body == {
            "message": f"Response with id {bad_id!r} not found.",
            "type": "invalid_request_error",
            "param": None,
            "code": "not_found",
        }
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id=UNKNOWN_ID)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "previous_response_id"
    assert fake.seen == []


def test_max_output_tokens_gives_incomplete(client: openai.OpenAI, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO, WORLD]], FinishReason.LENGTH.value)
    response = client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].status == "incomplete"
    assert response.output_text == "Hello world"
    assert response.max_output_tokens == 2 and fake.seen[-1].sampling.max_tokens == 2
    events = list(client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"


def test_store_false_is_not_retrievable(client: openai.OpenAI, fake: FakeBackend) -> None:
    response = client.responses.create(model=MODEL_NAME, input="hi", store=False)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL_NAME, input="hi", previous_response_id=response.id)
    with client.responses.stream(model=MODEL_NAME, input="hi", store=False) as stream:
        streamed = stream.get_final_response()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed.id)


def test_reasoning_is_accepted_and_ignored(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL_NAME, input="hi", reasoning={"effort": "low"})
    assert response.output_text == "Hello world!" and response.reasoning is None
