"""The official anthropic SDK, in strict mode, against the codec served by uvicorn over a fake backend."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import anthropic
import httpx2
import pytest
from anthropic.types import MessageParam

from services.codec.backend.protocol import GenerationRequest, TokenDelta
from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import (
    MODEL_NAME,
    FakeBackend,
    identity_for,
    make_app,
    make_config,
    scripted,
    serve_in_thread,
)

pytestmark = pytest.mark.model

MAX_BODY_BYTES = 16384
HI: list[MessageParam] = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def fake(model_dir: Path) -> FakeBackend:
    return FakeBackend(identity_for(model_dir).tokenizer_fingerprint)


@pytest.fixture(scope="module")
def base_url(model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend) -> Iterator[str]:
    config = make_config(max_body_bytes=MAX_BODY_BYTES)
    with serve_in_thread(make_app(tokenizer, fake, identity_for(model_dir), config)) as url:
        yield url


@pytest.fixture(autouse=True)
def fresh_fake(fake: FakeBackend) -> None:
    fake.reset()


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[anthropic.Anthropic]:
    """Strict and without retries: a missing field or a retried failure cannot hide."""
    with anthropic.Anthropic(
        base_url=base_url,
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
        http_client=httpx2.Client(timeout=30),
    ) as strict_client:
        yield strict_client


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def test_create_returns_text_stop_reason_and_usage_split_by_cache(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world! END")], num_cached_tokens=7)
    response = client.messages.with_raw_response.create(model=MODEL_NAME, max_tokens=32, messages=HI)
    message = response.parse()
    assert message.id.startswith("msg_") and message.model == MODEL_NAME
    assert message.content[0].type == "text" and message.content[0].text == "Hello world! END"
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    num_prompt_tokens = len(fake.seen[0].prompt_token_ids)
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (num_prompt_tokens - 7, 7)
    assert usage.cache_creation_input_tokens == 0
    assert usage.output_tokens == 5  # four text tokens and EOS
    assert message._request_id == response.headers["x-request-id"]
    assert fake.seen[0].sampling.max_tokens == 32


def test_stream_final_message_equals_create(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world! END")], num_cached_tokens=3)
    whole = client.messages.create(model=MODEL_NAME, max_tokens=32, messages=HI)
    with client.messages.stream(model=MODEL_NAME, max_tokens=32, messages=HI) as stream:
        streamed = stream.get_final_message()
    with client.messages.stream(model=MODEL_NAME, max_tokens=32, messages=HI) as stream:
        assert stream.get_final_text() == "Hello world! END"
    assert [block.model_dump(include={"type", "text"}) for block in streamed.content] == [
        block.model_dump(include={"type", "text"}) for block in whole.content
    ]
    assert streamed.usage == whole.usage
    assert (streamed.stop_reason, streamed.stop_sequence) == (whole.stop_reason, None)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_cuts_text_and_names_the_match(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world! END")])
    kwargs = {"model": MODEL_NAME, "max_tokens": 32, "messages": HI, "stop_sequences": ["!", "zz"]}
    if stream:
        with client.messages.stream(**kwargs) as events:  # type: ignore[arg-type]
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)  # type: ignore[call-overload]
    assert message.content[0].type == "text" and message.content[0].text == "Hello world"
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "!")
    assert fake.seen[0].request_id in fake.closed_early


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_is_stop_reason_max_tokens(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer, stream: bool
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world")], "length")
    kwargs = {"model": MODEL_NAME, "max_tokens": 2, "messages": HI}
    if stream:
        with client.messages.stream(**kwargs) as events:  # type: ignore[arg-type]
            message = events.get_final_message()
    else:
        message = client.messages.create(**kwargs)  # type: ignore[call-overload]
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 2)
    assert fake.seen[0].sampling.max_tokens == 2


def test_system_prompt_and_sampling_reach_the_backend(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hi")])
    client.messages.create(
        model=MODEL_NAME,
        max_tokens=8,
        system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        metadata={"user_id": "session-1"},
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},
    )
    seen = fake.seen[0]
    prompt = tokenizer.decode(seen.prompt_token_ids, skip_special_tokens=False)
    assert prompt == (
        "<|im_start|>system\nBe brief.\nBe kind.<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert (seen.sampling.temperature, seen.sampling.top_p, seen.sampling.top_k) == (0.5, 0.9, 40)


def test_final_assistant_message_is_a_prefill_that_the_reply_continues(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, " world")])
    messages: list[MessageParam] = [*HI, {"role": "assistant", "content": "Hello"}]
    message = client.messages.create(model=MODEL_NAME, max_tokens=8, messages=messages)
    assert message.content[0].type == "text" and message.content[0].text == " world"
    prompt = tokenizer.decode(fake.seen[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\nHello")
    assert fake.seen[0].prompt_token_ids[-1] == ids(tokenizer, "Hello")[-1]


def test_count_tokens_equals_the_prompt_a_create_would_send(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hi")], num_cached_tokens=5)
    messages: list[MessageParam] = [*HI, {"role": "assistant", "content": "Sure:"}]
    message = client.messages.create(model=MODEL_NAME, max_tokens=8, system="Be brief.", messages=messages)
    counted = client.messages.count_tokens(model=MODEL_NAME, system="Be brief.", messages=messages)
    usage = message.usage
    total = (
        usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)
    )
    assert counted.input_tokens == total == len(fake.seen[0].prompt_token_ids)
    assert len(fake.seen) == 1  # counting never reaches the backend


def test_errors_raise_the_matching_sdk_exceptions(client: anthropic.Anthropic, fake: FakeBackend) -> None:
    with pytest.raises(anthropic.NotFoundError) as not_found:
        client.messages.create(model="nope", max_tokens=8, messages=HI)
    assert not_found.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert not_found.value.request_id == not_found.value.response.headers["x-request-id"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL_NAME, max_tokens=8, messages=[])
    with pytest.raises(anthropic.BadRequestError, match="invalid schema"):
        client.messages.create(
            model=MODEL_NAME,
            max_tokens=8,
            messages=HI,
            tools=[
                {"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}
            ],
        )
    with pytest.raises(anthropic.ContentTooLargeError):
        client.messages.create(
            model=MODEL_NAME, max_tokens=8, messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}]
        )
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=HI)
    assert fake.seen == []


def test_backend_down_is_overloaded_with_retry_after(client: anthropic.Anthropic, fake: FakeBackend) -> None:
    fake.is_unavailable = True
    with pytest.raises(anthropic.ServiceUnavailableError) as caught:
        client.messages.create(model=MODEL_NAME, max_tokens=8, messages=HI)
    assert caught.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]
    assert caught.value.response.headers["retry-after"] == "1"


def test_mid_stream_failure_raises_api_status_error(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world! END")])
    fake.fail_after = 2
    with (
        pytest.raises(anthropic.APIStatusError, match="generation failed"),
        client.messages.stream(model=MODEL_NAME, max_tokens=32, messages=HI) as stream,
    ):
        stream.get_final_message()


def test_cache_control_breakpoints_end_where_their_blocks_end_and_the_usage_splits_what_was_written(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    rules = "Rule one: be brief. Rule two: be kind."
    policy = "Policy: tide tables only."
    tool = {"name": "tides", "description": "Tide tables", "input_schema": {"type": "object"}}
    play = scripted([ids(tokenizer, "Ok")])

    def script(request: GenerationRequest) -> list[TokenDelta]:  # the worker's count of what it wrote
        return [replace(delta, num_cache_written_tokens=(32, 0, 16, 5)) for delta in play(request)]

    fake.script = script
    message = client.messages.create(
        model=MODEL_NAME,
        max_tokens=8,
        tools=[{**tool, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],  # type: ignore[list-item]
        system=[{"type": "text", "text": rules, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": policy, "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "When is high tide?"},
                ],
            }
        ],
        cache_control={"type": "ephemeral"},
    )
    prompt = fake.seen[0].prompt_token_ids
    points = fake.seen[0].cache_breakpoints
    assert [p.ttl_s for p in points] == [3600, 3600, 300, 300]
    ends = [tokenizer.decode(prompt[: p.num_tokens], skip_special_tokens=False) for p in points]
    assert ends[0].endswith('"description": "Tide tables"}\n')  # right after the marked tool
    # SmolLM2's template writes the system prompt before the tools: that breakpoint ends with the tools'.
    assert rules in ends[1] and points[1].num_tokens == points[0].num_tokens
    assert ends[2].endswith(policy + "\n")  # right after the marked block (and the blocks' separator)
    assert points[3].num_tokens == len(prompt)  # the top-level one: the whole prompt
    usage = message.usage
    assert usage.cache_creation is not None
    assert (
        usage.cache_creation.ephemeral_1h_input_tokens,
        usage.cache_creation.ephemeral_5m_input_tokens,
    ) == (32, 21)
    assert usage.cache_creation_input_tokens == 53 and usage.cache_read_input_tokens == 0
    assert usage.input_tokens == len(prompt) - 53


def test_a_breakpoint_whose_block_the_template_does_not_show_marks_nothing(
    client: anthropic.Anthropic, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Ok")])
    tool = {"name": "tides", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    client.messages.create(
        model=MODEL_NAME,
        max_tokens=8,
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "none"},  # the template gets no tools: the marker never shows
        messages=HI,
    )
    assert [(p.num_tokens, p.ttl_s) for p in fake.seen[0].cache_breakpoints] == [(0, 300)]
