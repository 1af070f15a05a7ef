"""The official openai SDK, in strict mode, against the codec served by uvicorn over a fake backend."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted, serve_in_thread

pytestmark = pytest.mark.model

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def fake(model_dir: Path) -> FakeBackend:
    return FakeBackend(identity_for(model_dir).tokenizer_fingerprint)


@pytest.fixture(scope="module")
def base_url(model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend) -> Iterator[str]:
    with serve_in_thread(make_app(tokenizer, fake, identity_for(model_dir))) as url:
        yield url


@pytest.fixture(autouse=True)
def fresh_fake(fake: FakeBackend) -> None:
    fake.reset()


def sdk(base_url: str, *, strict: bool = True) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base_url}/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=strict,
        http_client=httpx2.Client(timeout=30),
    )


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    """Strict and without retries: a missing field or a retried failure cannot hide."""
    with sdk(base_url) as strict_client:
        yield strict_client


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)


def test_chat_create_returns_text_usage_and_cached_tokens(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world! END")], num_cached_tokens=7)
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, seed=11)
    choice = completion.choices[0]
    assert choice.message.content == "Hello world! END"
    assert choice.finish_reason == "stop"
    assert completion.model == MODEL_NAME
    assert completion.system_fingerprint and completion.system_fingerprint.startswith("fp_")
    assert completion.usage is not None
    assert completion.usage.prompt_tokens == len(fake.seen[0].prompt_token_ids)
    assert completion.usage.completion_tokens == 5  # four text tokens and EOS
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5
    assert (
        completion.usage.prompt_tokens_details and completion.usage.prompt_tokens_details.cached_tokens == 7
    )
    assert fake.seen[0].sampling.seed == 11


def test_chat_stream_final_completion_matches_the_text(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world! END")])
    with client.chat.completions.stream(model=MODEL_NAME, messages=USER) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Hello world! END"
    assert final.choices[0].finish_reason == "stop"


def test_include_usage_sends_one_usage_chunk_last(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world")], num_cached_tokens=3)
    chunks = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=USER, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None and last.usage.completion_tokens == 3
    assert last.usage.prompt_tokens_details and last.usage.prompt_tokens_details.cached_tokens == 3
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == "Hello world"


def test_stream_without_include_usage_has_no_usage_chunk(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello")])
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=USER, stream=True))
    assert all(chunk.usage is None and chunk.choices for chunk in chunks)


def test_n2_streams_both_choices_to_the_sdk_accumulator(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world!"), ids(tokenizer, " café END")])
    with client.chat.completions.stream(model=MODEL_NAME, messages=USER, n=2) as stream:
        final = stream.get_final_completion()
    assert [c.message.content for c in final.choices] == ["Hello world!", " café END"]
    assert [c.index for c in final.choices] == [0, 1]
    assert fake.seen[0].sampling.n == 2
    plain = client.chat.completions.create(model=MODEL_NAME, messages=USER, n=2)
    assert [c.message.content for c in plain.choices] == ["Hello world!", " café END"]


def test_chat_logprobs_have_openai_shape(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world")], logprobs=True)
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=USER, logprobs=True, top_logprobs=2
    )
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [item.token for item in logprobs.content][:2] == ["Hello", " world"]
    assert [item.logprob for item in logprobs.content] == [-0.1, -0.2, -0.3]  # EOS last
    assert logprobs.content[1].bytes == list(b" world")
    assert [top.token for top in logprobs.content[0].top_logprobs] == ["Hello", tokenizer.decode([0], False)]
    assert fake.seen[0].sampling.logprobs == 2
    with client.chat.completions.stream(model=MODEL_NAME, messages=USER, logprobs=True) as stream:
        streamed = stream.get_final_completion().choices[0].logprobs
    assert streamed is not None and streamed.content is not None
    assert [item.token for item in streamed.content] == [item.token for item in logprobs.content]
    assert all(item.top_logprobs == [] for item in streamed.content)


def test_stop_string_across_tokens_is_cut_and_never_streamed(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world! END and more")])
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=USER, stream=True, stop=["d! E"]))
    deltas = [c.choices[0].delta.content for c in chunks]
    assert deltas == ["", "Hello", " worl", None]  # "d" and "!" were held back, then cut with the stop
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert fake.closed_early == [fake.seen[0].request_id]  # the rest was aborted behind us


def test_max_tokens_ends_with_length(client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world!")], "length")
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=USER, stream=True, max_tokens=3))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert fake.seen[0].sampling.max_tokens == 3
    completion = client.chat.completions.create(model=MODEL_NAME, messages=USER, max_completion_tokens=3)
    assert completion.choices[0].finish_reason == "length"
    with (
        pytest.raises(openai.LengthFinishReasonError),
        client.chat.completions.stream(model=MODEL_NAME, messages=USER, max_tokens=3) as stream,
    ):
        stream.get_final_completion()  # the SDK helper refuses "length" by design


def test_mid_stream_failure_is_an_in_band_api_error(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hello world! END")])
    fake.fail_after = 2
    stream = client.chat.completions.create(model=MODEL_NAME, messages=USER, stream=True)
    with pytest.raises(openai.APIError, match="generation failed"):
        for _ in stream:
            pass


def test_backend_unavailable_is_503_with_retry_after(client: openai.OpenAI, fake: FakeBackend) -> None:
    fake.is_unavailable = True
    with pytest.raises(openai.InternalServerError) as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=USER)
    assert raised.value.status_code == 503
    assert raised.value.response.headers["retry-after"] == "1"
    assert raised.value.response.headers["x-request-id"]


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI, fake: FakeBackend) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="gpt-nope", messages=USER)
    assert raised.value.code == "model_not_found"
    assert raised.value.param == "model"
    assert fake.seen == []


def test_every_response_carries_x_request_id(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, "Hi")])
    raw = client.chat.completions.with_raw_response.create(model=MODEL_NAME, messages=USER)
    assert raw.headers["x-request-id"].startswith("req_")
    streamed = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=USER, stream=True, extra_headers={"x-request-id": "client-abc.1"}
    )
    assert streamed.headers["x-request-id"] == "client-abc.1"
    assert re.fullmatch(r"req_[0-9a-f]{24}", fake.seen[-1].request_id)  # the inward ID is the server's own
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL_NAME, messages=[])
    assert raised.value.response.headers["x-request-id"].startswith("req_")


def test_completions_non_stream_and_token_id_prompt(
    client: openai.OpenAI, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([ids(tokenizer, " world!")], logprobs=True)
    completion = client.completions.create(model=MODEL_NAME, prompt="Hello", logprobs=1)
    choice = completion.choices[0]
    assert choice.text == " world!"
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None
    assert choice.logprobs.tokens == [" world", "!", tokenizer.decode([2], False)]
    assert choice.logprobs.text_offset == [0, 6, 7]
    assert fake.seen[0].prompt_token_ids == ids(tokenizer, "Hello")
    by_ids = client.completions.create(model=MODEL_NAME, prompt=[19556, 905], max_tokens=4)
    assert by_ids.choices[0].text == " world!"
    assert fake.seen[1].prompt_token_ids == [19556, 905]
    assert fake.seen[1].sampling.max_tokens == 4


def test_completions_stream(base_url: str, fake: FakeBackend, tokenizer: Tokenizer) -> None:
    fake.script = scripted([ids(tokenizer, " world!")], "length")
    # Non-strict: openai 3.57 types a completion chunk's finish_reason as required, yet OpenAI (and we)
    # send null until the last chunk; strict validation would reject OpenAI's own stream.
    with sdk(base_url, strict=False) as lenient:
        stream = lenient.completions.create(
            model=MODEL_NAME, prompt="Hello", stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " world!"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2


def test_models_list_names_the_served_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
