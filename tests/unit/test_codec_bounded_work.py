"""Work before admission is bounded (issue 22): a prompt's text over limits.max_input_bytes is a 400 before
the tokenizer sees it, on every protocol and on /tokenize; templating and tokenizing run off the event
loop, at most limits.prompt_workers at once; and /tokenize needs a key like every other route."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from services.codec.text.prompts import PromptEncoder
from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, LimitsConfig
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

pytestmark = pytest.mark.model

MAX_INPUT_BYTES = 4096
BIG = "é" * MAX_INPUT_BYTES  # 2 bytes each: twice the cap, though only the cap in characters
ROUTES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": MODEL_NAME, "messages": [{"role": "user", "content": BIG}]}),
    "completions": ("/v1/completions", {"model": MODEL_NAME, "prompt": BIG}),
    "responses": ("/v1/responses", {"model": MODEL_NAME, "input": BIG}),
    "messages": (
        "/v1/messages",
        {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": BIG}]},
    ),
    "count_tokens": (
        "/v1/messages/count_tokens",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": BIG}]},
    ),
    "tokenize": ("/tokenize", {"prompt": BIG}),
    "tokenize_chat": ("/tokenize", {"messages": [{"role": "user", "content": BIG}]}),
}


class CountingTokenizer:
    """The real tokenizer, recording which threads encode and how many encode at once."""

    def __init__(self, real: Tokenizer) -> None:
        self._real = real
        self.threads: list[str] = []
        self.active = 0
        self.most_active = 0
        self.gate: threading.Event | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
            self.threads.append(threading.current_thread().name)
        try:
            if self.gate is not None:
                self.gate.wait(10)
            return self._real.encode(text, add_special_tokens=add_special_tokens)
        finally:
            with self._lock:
                self.active -= 1


@pytest.fixture
def fake(model_dir: Path) -> FakeBackend:
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    backend.script = scripted([[19556]])
    return backend


@pytest.fixture
def tokenizer(model_dir: Path) -> CountingTokenizer:
    return CountingTokenizer(Tokenizer.from_dir(model_dir))


@pytest.fixture
async def client(
    model_dir: Path, fake: FakeBackend, tokenizer: CountingTokenizer
) -> AsyncIterator[httpx.AsyncClient]:
    config = KvrelayConfig(limits=LimitsConfig(max_input_bytes=MAX_INPUT_BYTES, prompt_workers=1))
    app = make_app(tokenizer, fake, identity_for(model_dir), config)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


@pytest.mark.parametrize("route", sorted(ROUTES))
async def test_text_over_the_byte_cap_is_a_400_before_tokenizing(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: CountingTokenizer, route: str
) -> None:
    path, body = ROUTES[route]
    response = await client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "limits.max_input_bytes" in error["message"] and f"of {MAX_INPUT_BYTES}" in error["message"]
    assert tokenizer.threads == [] and fake.seen == []


async def test_prompts_are_tokenized_off_the_event_loop_one_at_a_time(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: CountingTokenizer
) -> None:
    """prompt_workers 1: while one request's tokenizing is held, a second waits its turn; the event loop
    stays free throughout (it answers /health meanwhile)."""
    tokenizer.gate = threading.Event()
    statuses: list[int] = []

    async def tokenize() -> None:
        statuses.append((await client.post("/tokenize", json={"prompt": "hello there"})).status_code)

    async with anyio.create_task_group() as group:
        group.start_soon(tokenize)
        group.start_soon(tokenize)
        with anyio.fail_after(10):
            while tokenizer.active == 0:
                await anyio.sleep(0.01)
        assert (await client.get("/health")).status_code == 200  # the loop is not blocked by the encode
        assert tokenizer.active == 1
        tokenizer.gate.set()
    assert statuses == [200, 200]
    assert tokenizer.most_active == 1
    assert all(name != threading.main_thread().name for name in tokenizer.threads), tokenizer.threads


def test_the_encoder_caps_by_utf8_bytes_not_characters(model_dir: Path) -> None:
    class Timer:
        def time_stage(self, stage: str) -> Any:
            return _nothing()

    encoder = PromptEncoder(Tokenizer.from_dir(model_dir), Timer(), max_bytes=8, workers=1)
    assert anyio.run(encoder.text, "abcdefgh")  # 8 bytes: at the cap
    with pytest.raises(Exception, match="9 bytes"):
        anyio.run(encoder.text, "abcdefgé")  # 8 characters, 9 bytes


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


async def test_tokenize_detokenize_and_count_tokens_count_against_the_request_quota(
    model_dir: Path, fake: FakeBackend, tokenizer: CountingTokenizer
) -> None:
    config = KvrelayConfig.model_validate({"quotas": {"default_requests_per_minute": 3}})
    app = make_app(tokenizer, fake, identity_for(model_dir), config)  # type: ignore[arg-type]
    count = (
        "/v1/messages/count_tokens",
        {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
    )
    calls = [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]}), count]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        for path, body in calls:
            assert (await client.post(path, json=body)).status_code == 200, path
        refused = await client.post("/tokenize", json={"prompt": "hi"})
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limit_exceeded" and refused.headers["retry-after"]
