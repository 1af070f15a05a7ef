"""The exact-result cache in the codec (services/codec/backend/results.py), over a fake backend and a real
Redis, with the official openai SDK (strict, no retries): a repeated greedy or seeded request that asks is
replayed without the backend, through the normal output path (stop strings, logprobs, streaming, fresh
IDs); what is not eligible, not finished or not asked for never is; a store that does not answer is a
miss; a replay is charged to the tenant's quotas like a generation. The real stack's test (the engine's
counters, tool calls, a second tenant) is in tests/e2e/test_cache_knobs_sdk.py."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from openai.types.chat import ChatCompletionMessageParam

from services.codec.backend.protocol import TokenDelta
from services.codec.backend.results import ResultCache
from services.codec.metrics import CodecMetrics
from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, QuotasConfig, ResultCacheConfig, TenantQuota
from services.common.outputs import FinishReason
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted, serve_in_thread
from tests.kv_helpers import cache_redis_url
from tests.ports import free_port
from tests.stack_helpers import wait_until
from tests.unit.test_codec_grpc_public import chat as grpc_chat
from tests.unit.test_codec_grpc_public import serve_api, texts

pytestmark = pytest.mark.model

USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Say hello."}]
USE = {"x-kvrelay-result-cache": "use"}


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with cache_redis_url(16) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


class Codec:
    """A codec over a fake backend with the result cache at `url`, its SDK client and raw HTTP."""

    def __init__(
        self, url: str, model_dir: Path, tokenizer: Tokenizer, tenants: tuple[str, ...] = ("default",),
        **settings: Any,
    ) -> None:  # fmt: skip
        self.fake = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
        cache = ResultCacheConfig(
            url=url, tenants=list(tenants), key_prefix=f"t-{uuid.uuid4().hex}:", timeout_ms=10_000
        )  # what is stored is checked here, not how fast
        config = KvrelayConfig(result_cache=cache, **settings)
        self.app = make_app(tokenizer, self.fake, identity_for(model_dir), config)
        self.tokenizer = tokenizer

    def script(self, text: str, **options: Any) -> None:
        self.fake.script = scripted([self.tokenizer.encode(text)], **options)


@pytest.fixture
def codec(redis_url: str, model_dir: Path, tokenizer: Tokenizer) -> Iterator[tuple[Codec, str]]:
    made = Codec(redis_url, model_dir, tokenizer)
    with serve_in_thread(made.app) as base_url:
        yield made, base_url


def sdk(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{base_url}/v1", api_key="x", max_retries=0, _strict_response_validation=True
    )


def chat(base_url: str, headers: dict[str, str] | None = USE, **fields: Any) -> tuple[Any, str | None]:
    """A chat completion and its x-kvrelay-result-cache header."""
    raw = sdk(base_url).chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=USER, extra_headers=headers or {}, **fields
    )
    return raw.parse(), raw.headers.get("x-kvrelay-result-cache")


def metric(base_url: str, name: str, **labels: str) -> float:
    """One sample of the codec's /metrics (0 when absent)."""
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def written(base_url: str) -> float:
    return metric(base_url, "kvrelay_codec_result_cache_bytes_total", direction="written", tenant="default")


def wait_written(base_url: str, before: float) -> None:
    """Until a result write that started after `before` was read has landed."""
    wait_until(lambda: written(base_url) > before, 10, "the result write")


def test_a_repeated_greedy_request_is_replayed_without_the_backend(codec: tuple[Codec, str]) -> None:
    made, base_url = codec
    made.script("Hello world! END and more", logprobs=True)
    fields = {"temperature": 0.0, "stop": ["END"], "logprobs": True, "top_logprobs": 2, "max_tokens": 20}
    first, header = chat(base_url, **fields)
    assert header == "miss" and len(made.fake.seen) == 1
    wait_written(base_url, 0.0)
    again, header = chat(base_url, **fields)
    assert header == "hit" and len(made.fake.seen) == 1  # the backend was not called
    assert again.choices[0].message.content == first.choices[0].message.content == "Hello world! "
    assert again.choices[0].finish_reason == first.choices[0].finish_reason == "stop"
    assert again.choices[0].logprobs == first.choices[0].logprobs
    assert again.id != first.id
    assert again.usage is not None and first.usage is not None
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.completion_tokens == first.usage.completion_tokens
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens == again.usage.prompt_tokens  # nothing computed
    streamed = sdk(base_url).chat.completions.create(
        model=MODEL_NAME, messages=USER, stream=True, extra_headers=USE, **fields
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    assert text == "Hello world! " and len(made.fake.seen) == 1
    lookups = "kvrelay_codec_result_cache_lookups_total"
    assert metric(base_url, lookups, outcome="hit", tenant="default") == 2
    assert metric(base_url, lookups, outcome="miss", tenant="default") == 1


def test_a_seeded_request_is_cached_an_unseeded_or_unasked_one_never(codec: tuple[Codec, str]) -> None:
    made, base_url = codec
    made.script("Sampled words here")
    before = written(base_url)
    _, header = chat(base_url, temperature=0.8, seed=7)
    assert header == "miss"
    wait_written(base_url, before)
    _, header = chat(base_url, temperature=0.8, seed=7)
    assert header == "hit" and len(made.fake.seen) == 1
    _, header = chat(base_url, temperature=0.8, seed=8)  # another seed: another key
    assert header == "miss" and len(made.fake.seen) == 2
    for _ in range(2):
        _, header = chat(base_url, temperature=0.8)  # unseeded sampling is meant to vary
        assert header == "skip"
    assert len(made.fake.seen) == 4
    _, header = chat(base_url, headers=None, temperature=0.8, seed=7)  # not asked: no cache, no header
    assert header is None and len(made.fake.seen) == 5


def test_a_failed_or_abandoned_generation_is_never_stored(codec: tuple[Codec, str]) -> None:
    made, base_url = codec
    made.script("One two three four five six")
    made.fake.fail_after = 3
    with pytest.raises(openai.APIError):
        chat(base_url, temperature=0.0)
    made.fake.fail_after = None
    made.fake.stall_before = 2  # the client leaves while it waits for the third token
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", headers=USE,
        json={"model": MODEL_NAME, "messages": USER, "temperature": 0.0, "stream": True},
    ) as response:  # fmt: skip
        assert response.headers["x-kvrelay-result-cache"] == "miss"
        next(response.iter_lines())
    wait_until(lambda: len(made.fake.closed_early) == 1, 10, "the abandoned stream's abort")
    made.fake.stall_before = None
    _, header = chat(base_url, temperature=0.0)
    assert header == "miss" and len(made.fake.seen) == 3
    assert written(base_url) > 0  # the finished one was stored, and only it


def test_a_tenant_that_did_not_opt_in_and_a_store_that_does_not_answer_are_misses(
    redis_url: str, model_dir: Path, tokenizer: Tokenizer
) -> None:
    closed = f"redis://127.0.0.1:{free_port()}/0"
    down = Codec(closed, model_dir, tokenizer)
    with serve_in_thread(down.app) as base_url:
        down.script("Still answered")
        reply, header = chat(base_url, temperature=0.0)
        assert reply.choices[0].message.content == "Still answered" and header == "miss"
        errors = "kvrelay_codec_result_cache_errors_total"
        assert metric(base_url, errors, operation="get") == 1
    skipped = Codec(redis_url, model_dir, tokenizer, tenants=("someone-else",))
    with serve_in_thread(skipped.app) as base_url:
        skipped.script("Not for this tenant")
        for _ in range(2):
            _, header = chat(base_url, temperature=0.0)
            assert header == "skip"
        assert len(skipped.fake.seen) == 2


def test_a_replay_is_charged_to_the_quotas_like_a_generation(
    redis_url: str, model_dir: Path, tokenizer: Tokenizer
) -> None:
    """Each request reserves prompt + max_tokens and settles to what it used (about 40 tokens here): two
    fit in 100 tokens a minute, and a third is refused, although the second was a replay."""
    quotas = QuotasConfig(tenants={"default": TenantQuota(tokens_per_minute=100)})
    made = Codec(redis_url, model_dir, tokenizer, quotas=quotas)
    with serve_in_thread(made.app) as base_url:
        made.script("Hi")
        _, header = chat(base_url, temperature=0.0, max_tokens=4)
        assert header == "miss"
        wait_written(base_url, 0.0)
        _, header = chat(base_url, temperature=0.0, max_tokens=4)
        assert header == "hit" and len(made.fake.seen) == 1
        with pytest.raises(openai.RateLimitError):
            chat(base_url, temperature=0.0, max_tokens=4)


def test_system_fingerprint_names_the_workers_numerics_and_mode(
    redis_url: str, model_dir: Path, tokenizer: Tokenizer
) -> None:
    made = Codec(redis_url, model_dir, tokenizer)
    made.fake.model_fingerprint, made.fake.numerics = "0123456789abcdef" * 4, "deterministic"
    with serve_in_thread(made.app) as base_url:
        made.script("Hi")
        reply, _ = chat(base_url, temperature=0.0)
    assert reply.system_fingerprint == "fp_0123456789ab_det"


async def test_the_public_grpc_api_asks_with_metadata_and_reads_the_outcome_in_trailers(
    redis_url: str, model_dir: Path, tokenizer: Tokenizer
) -> None:
    cache = ResultCacheConfig(
        url=redis_url, tenants=["*"], key_prefix=f"t-{uuid.uuid4().hex}:", timeout_ms=10_000
    )
    identity = identity_for(model_dir)
    async for api in serve_api(tokenizer, identity, KvrelayConfig(result_cache=cache)):
        api.fake.script = scripted([tokenizer.encode(" Paris.", add_special_tokens=False)])
        outcomes, answers = [], []
        for _ in range(2):
            call = api.stub.Chat(grpc_chat(temperature=0.0), metadata=(("x-kvrelay-result-cache", "use"),))
            answers.append(texts([message async for message in call]))
            outcomes.append(dict(await call.trailing_metadata())["x-kvrelay-result-cache"])
            if outcomes[-1] == "miss":
                results = api.state.generator.results
                assert results is not None
                await results.drain()
        assert outcomes == ["miss", "hit"] and answers[0] == answers[1] == {0: " Paris."}
        assert len(api.fake.seen) == 1


async def test_a_tenant_index_evicted_by_the_lru_never_breaks_later_writes(redis_url: str) -> None:
    """The shared tier's Redis evicts keys one by one (allkeys-lru): a tenant's index and sizes may go while
    its byte total stays above the cap. The next write starts the tenant's bookkeeping over, never fails."""
    prefix = f"t-{uuid.uuid4().hex}:"
    settings = {"url": redis_url, "tenants": ["*"], "key_prefix": prefix, "timeout_ms": 10_000}
    config = KvrelayConfig(result_cache=ResultCacheConfig(**settings, tenant_capacity_mb=1))
    cache = ResultCache.from_config(config, CodecMetrics().result_cache, {})
    assert cache is not None
    delta = TokenDelta(0, [7, 8, 9], [], FinishReason.STOP, 4, 0)
    cache.store_later("0" * 64, "t", [delta])
    await cache.drain()
    client = aioredis.Redis.from_url(redis_url)
    await client.delete(f"{prefix}t:index", f"{prefix}t:sizes")  # evicted; ":bytes" kept
    await client.set(f"{prefix}t:bytes", 10 * 2**20)  # over the cap: the next write must drop
    for key in ("1" * 64, "2" * 64):
        cache.store_later(key, "t", [delta])
        await cache.drain()
    assert cache.metrics.errors.labels(operation="put")._value.get() == 0
    assert await cache.lookup("2" * 64, "t") is not None
    await client.aclose()
    await cache.aclose()
