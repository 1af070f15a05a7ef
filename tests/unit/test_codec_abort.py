"""A client that goes away aborts the request behind the codec (the backend stream is closed)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted, serve_in_thread

pytestmark = pytest.mark.model

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count."}]
CHAT = {"model": MODEL_NAME, "messages": MESSAGES}


@pytest.fixture(scope="module")
def fake(model_dir: Path) -> FakeBackend:
    return FakeBackend(identity_for(model_dir).tokenizer_fingerprint)


@pytest.fixture(scope="module")
def base_url(model_dir: Path, fake: FakeBackend) -> Iterator[str]:
    tokenizer = Tokenizer.from_dir(model_dir)
    with serve_in_thread(make_app(tokenizer, fake, identity_for(model_dir))) as url:
        yield url


@pytest.fixture(autouse=True)
def slow_long_stream(fake: FakeBackend, model_dir: Path) -> None:
    fake.reset()
    fake.script = scripted([Tokenizer.from_dir(model_dir).encode(" one" * 400)])
    fake.delay_s = 0.02  # 400 tokens: about 8 s if nobody aborts


def wait_for(
    condition: Callable[[], bool], timeout_s: float = 5.0, what: str = "the backend stream to be closed"
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.01)


def test_closing_an_sse_stream_aborts_the_backend(base_url: str, fake: FakeBackend) -> None:
    with (
        httpx.Client(base_url=base_url, timeout=10) as client,
        client.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as response,
    ):
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    wait_for(lambda: len(fake.closed_early) == 1)
    assert fake.closed_early == [fake.seen[0].request_id]
    assert fake.completed == []


def test_closing_an_sdk_stream_aborts_the_backend(base_url: str, fake: FakeBackend) -> None:
    with openai.OpenAI(
        base_url=f"{base_url}/v1",
        api_key="x",
        max_retries=0,
        _strict_response_validation=True,
        http_client=httpx2.Client(timeout=10),
    ) as client:
        stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True)
        first = next(iter(stream))
        assert first.choices[0].delta.role == "assistant"
        stream.close()
        wait_for(lambda: len(fake.closed_early) == 1)
    assert fake.completed == []


def test_a_client_timing_out_on_a_plain_request_aborts_the_backend(base_url: str, fake: FakeBackend) -> None:
    with httpx.Client(base_url=base_url, timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json=CHAT)
    wait_for(lambda: len(fake.closed_early) == 1)
    assert fake.completed == []


def test_aborted_requests_are_counted_as_client_closed(base_url: str, fake: FakeBackend) -> None:
    with (
        httpx.Client(base_url=base_url, timeout=10) as client,
        client.stream(
            "POST", "/v1/completions", json={"model": MODEL_NAME, "prompt": "1", "stream": True}
        ) as r,
    ):
        next(r.iter_lines())
    wait_for(lambda: len(fake.closed_early) == 1)
    metrics = ""

    def counted() -> bool:
        nonlocal metrics
        metrics = httpx.get(f"{base_url}/metrics").text
        return 'kvrelay_requests_total{protocol="completions",status="499"} 1.0' in metrics

    wait_for(counted, what="the 499 in the metrics")


@pytest.mark.parametrize("stream", [False, True])
def test_leaving_while_queued_for_the_first_token_aborts_at_once(
    base_url: str, fake: FakeBackend, stream: bool
) -> None:
    """No response byte has gone out yet, so only the disconnect itself can tell the codec: the backend
    never produces a first token (it waits until its stream is closed), and the stream must be closed."""
    fake.stall_before = 0
    with httpx.Client(base_url=base_url, timeout=0.3) as client, pytest.raises(httpx.ReadTimeout):
        client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    wait_for(lambda: len(fake.closed_early) == 1, timeout_s=15.0)
    assert fake.closed_early == [fake.seen[0].request_id]
    assert fake.completed == []
