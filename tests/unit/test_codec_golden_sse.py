"""Golden SSE transcripts: a fixed fake token stream must give exactly these bytes (written by hand
from the OpenAI streaming sequence), and the same bytes must pass the openai SDK's strict parser."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from services.codec.state import CodecIdentity
from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

pytestmark = pytest.mark.model

HELLO, WORLD, BANG, IM_END = 19556, 905, 17, 2  # "Hello", " world", "!", "<|im_end|>" in SmolLM2
NUM_HI_PROMPT_TOKENS = 31  # [{"role": "user", "content": "hi"}] with SmolLM2's default system prompt
MODEL_FINGERPRINT = "0123456789abcdef" * 4

SAME = '"created":0,"model":"smollm2-test","system_fingerprint":"fp_0123456789ab"'  # every chunk
HELLO_BYTES = "[72,101,108,108,111]"
IM_END_BYTES = "[60,124,105,109,95,101,110,100,124,62]"
DONE = "data: [DONE]\n\n"


def chat(rest: str) -> str:  # the chunks say the tier that served the request (docs/priority.md)
    return (
        'data: {"id":"ID","object":"chat.completion.chunk",'
        + SAME
        + ',"service_tier":"default",'
        + rest
        + "}\n\n"
    )


def text(rest: str) -> str:
    return 'data: {"id":"ID","object":"text_completion",' + SAME + "," + rest + "}\n\n"


ROLE = '{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}'
ROLE_1 = '{"index":1,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}'
STOP_0 = '"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]'

GOLDEN_CHAT_WITH_USAGE = (
    chat('"choices":[' + ROLE + "]")
    + chat('"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]')
    + chat('"choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]')
    + chat('"choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,"finish_reason":null}]')
    + chat(STOP_0)
    + chat(
        '"choices":[],"usage":{"prompt_tokens":31,"completion_tokens":4,"total_tokens":35,'
        '"prompt_tokens_details":{"cached_tokens":4}}'
    )
    + DONE
)

GOLDEN_CHAT_N2 = (
    chat('"choices":[' + ROLE + "," + ROLE_1 + "]")
    + chat('"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]')
    + chat('"choices":[{"index":1,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]')
    + chat(STOP_0)
    + chat('"choices":[{"index":1,"delta":{},"logprobs":null,"finish_reason":"stop"}]')
    + DONE
)

GOLDEN_CHAT_LOGPROBS = (
    chat('"choices":[' + ROLE + "]")
    + chat(
        '"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":{"content":['
        '{"token":"Hello","logprob":-0.1,"bytes":' + HELLO_BYTES + ',"top_logprobs":['
        '{"token":"Hello","logprob":-0.1,"bytes":' + HELLO_BYTES + "}]}],"
        '"refusal":null},"finish_reason":null}]'
    )
    + chat(
        '"choices":[{"index":0,"delta":{"content":""},"logprobs":{"content":['
        '{"token":"<|im_end|>","logprob":-0.2,"bytes":' + IM_END_BYTES + ',"top_logprobs":['
        '{"token":"<|im_end|>","logprob":-0.2,"bytes":' + IM_END_BYTES + "}]}],"
        '"refusal":null},"finish_reason":null}]'
    )
    + chat(STOP_0)
    + DONE
)

GOLDEN_CHAT_FAILS_MID_STREAM = (
    chat('"choices":[' + ROLE + "]")
    + chat('"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,"finish_reason":null}]')
    + chat('"choices":[{"index":0,"delta":{"content":" world"},"logprobs":null,"finish_reason":null}]')
    + 'data: {"error":{"message":"generation failed in the serving stack (request golden-1)",'
    '"type":"server_error","param":null,"code":null}}\n\n'
)

GOLDEN_COMPLETION_LENGTH = (
    text('"choices":[{"index":0,"text":" world","logprobs":null,"finish_reason":null}]')
    + text('"choices":[{"index":0,"text":"!","logprobs":null,"finish_reason":null}]')
    + text('"choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length"}]')
    + DONE
)

HI: list[ChatCompletionMessageParam] = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path) -> FakeBackend:
    return FakeBackend(identity_for(model_dir).tokenizer_fingerprint, model_fingerprint=MODEL_FINGERPRINT)


@pytest.fixture
def client(model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend) -> httpx.AsyncClient:
    identity = CodecIdentity(MODEL_NAME, identity_for(model_dir).tokenizer_fingerprint, MODEL_FINGERPRINT)
    app = make_app(tokenizer, fake, identity)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec")


async def transcript(client: httpx.AsyncClient, path: str, body: dict[str, Any], **headers: str) -> str:
    """The response body with the per-request id and timestamp replaced by placeholders."""
    response = await client.post(path, json={"model": MODEL_NAME, "stream": True, **body}, headers=headers)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"
    text = response.text
    assert "\r" not in text
    assert len(set(re.findall(r'"id":"((?:chatcmpl|cmpl)-[0-9a-f]{32})"', text))) <= 1  # one id per stream
    text = re.sub(r'"id":"(chatcmpl|cmpl)-[0-9a-f]{32}"', '"id":"ID"', text)
    return re.sub(r'"created":\d+', '"created":0', text)


def replay(golden: str, *, strict: bool = True) -> openai.OpenAI:
    """An SDK client (strict by default) whose every response is `golden`."""

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=golden.encode())

    return openai.OpenAI(
        base_url="http://golden/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=strict,
        http_client=httpx2.Client(transport=httpx2.MockTransport(handler)),
    )


async def test_chat_stream_with_usage_is_byte_exact(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO, WORLD, BANG]], num_cached_tokens=4)
    body = {"messages": HI, "stream_options": {"include_usage": True}}
    assert await transcript(client, "/v1/chat/completions", body) == GOLDEN_CHAT_WITH_USAGE
    assert len(fake.seen[0].prompt_token_ids) == NUM_HI_PROMPT_TOKENS
    with replay(GOLDEN_CHAT_WITH_USAGE).chat.completions.stream(model=MODEL_NAME, messages=HI) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.content == "Hello world!"
    assert final.usage is not None and final.usage.total_tokens == 35


async def test_chat_stream_n2_is_byte_exact(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO], [WORLD]])
    assert await transcript(client, "/v1/chat/completions", {"messages": HI, "n": 2}) == GOLDEN_CHAT_N2
    with replay(GOLDEN_CHAT_N2).chat.completions.stream(model=MODEL_NAME, messages=HI, n=2) as stream:
        final = stream.get_final_completion()
    assert [choice.message.content for choice in final.choices] == ["Hello", " world"]


async def test_chat_stream_logprobs_is_byte_exact(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[HELLO]], logprobs=True)
    body = {"messages": HI, "logprobs": True, "top_logprobs": 1}
    assert await transcript(client, "/v1/chat/completions", body) == GOLDEN_CHAT_LOGPROBS
    with replay(GOLDEN_CHAT_LOGPROBS).chat.completions.stream(model=MODEL_NAME, messages=HI) as stream:
        final = stream.get_final_completion()
    logprobs = final.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert [item.token for item in logprobs.content] == ["Hello", "<|im_end|>"]


async def test_mid_stream_failure_is_one_error_event_then_close(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    fake.script = scripted([[HELLO, WORLD, BANG]])
    fake.fail_after = 2
    text = await transcript(client, "/v1/chat/completions", {"messages": HI}, **{"x-request-id": "golden-1"})
    assert text == GOLDEN_CHAT_FAILS_MID_STREAM
    stream = replay(GOLDEN_CHAT_FAILS_MID_STREAM).chat.completions.create(
        model=MODEL_NAME, messages=HI, stream=True
    )
    with pytest.raises(openai.APIError, match="generation failed"):
        list(stream)


async def test_completion_stream_is_byte_exact(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    fake.script = scripted([[WORLD, BANG]], "length")
    body = {"prompt": [HELLO], "max_tokens": 2}
    assert await transcript(client, "/v1/completions", body) == GOLDEN_COMPLETION_LENGTH
    assert fake.seen[0].prompt_token_ids == [HELLO]
    # openai 3.57's strict Completion type rejects the null finish_reason OpenAI itself streams, so the
    # replay is non-strict here; the byte comparison above is the exact check.
    lenient = replay(GOLDEN_COMPLETION_LENGTH, strict=False)
    chunks = list(lenient.completions.create(model=MODEL_NAME, prompt=[HELLO], stream=True))
    assert [chunk.choices[0].text for chunk in chunks] == [" world", "!", ""]
    assert chunks[-1].choices[0].finish_reason == "length"
