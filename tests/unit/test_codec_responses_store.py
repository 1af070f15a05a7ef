"""The response store: tenant scoping, expiry and eviction, the Redis implementation (real Redis on
127.0.0.1:6379, a unique key prefix per test) shared by two codec apps, and the env-var factory."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from fastapi import FastAPI

from services.codec.protocols.openai_responses import install_responses, response_store
from services.codec.response_store import (
    REDIS_URL_ENV,
    InMemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    StoredResponse,
    store_from_config,
)
from services.codec.text.tokenizer import Tokenizer
from services.common.config import ResponsesConfig
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted, serve_in_thread

REDIS_URL = "redis://127.0.0.1:6379/0"
TTL_S = 60


def record(text: str = "Hello") -> StoredResponse:
    response_id = f"resp_{uuid.uuid4().hex}"
    body = {"id": response_id, "object": "response", "output_text": text}
    return StoredResponse(response_id, body, [{"role": "user", "content": "hi"}])


@pytest.fixture
async def redis_prefix() -> AsyncIterator[str]:
    """A key prefix no other test uses; every key under it is deleted afterwards."""
    prefix = f"kvrelay-test:{uuid.uuid4().hex}:"
    yield prefix
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def redis_store(prefix: str) -> RedisResponseStore:
    return RedisResponseStore.from_url(REDIS_URL, ttl_s=TTL_S, key_prefix=prefix)


StoreFactory = Callable[[str], ResponseStore]
FACTORIES: dict[str, StoreFactory] = {"memory": lambda prefix: InMemoryResponseStore(), "redis": redis_store}


@pytest.fixture(params=sorted(FACTORIES))
async def store(request: pytest.FixtureRequest, redis_prefix: str) -> AsyncIterator[ResponseStore]:
    made = FACTORIES[request.param](redis_prefix)
    yield made
    await made.aclose()


async def test_put_get_delete_round_trip(store: ResponseStore) -> None:
    kept = record()
    await store.put("default", kept)
    assert await store.get("default", kept.response_id) == kept
    assert await store.delete("default", kept.response_id) is True
    assert await store.get("default", kept.response_id) is None
    assert await store.delete("default", kept.response_id) is False


async def test_a_tenant_never_sees_another_tenants_response(store: ResponseStore) -> None:
    kept = record()
    await store.put("tenant-a", kept)
    assert await store.get("tenant-b", kept.response_id) is None
    assert await store.delete("tenant-b", kept.response_id) is False
    assert await store.get("tenant-a", kept.response_id) == kept  # B's delete did not touch A's


async def test_tenant_names_cannot_spell_another_tenants_key(store: ResponseStore) -> None:
    kept = record()
    await store.put("a:b", kept)
    assert await store.get("a", f"b:{kept.response_id}") is None


async def test_redis_keys_expire_after_the_ttl(redis_prefix: str) -> None:
    store = redis_store(redis_prefix)
    kept = record()
    await store.put("default", kept)
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        assert 0 < await client.ttl(store.key("default", kept.response_id)) <= TTL_S
    finally:
        await client.aclose()
        await store.aclose()


async def test_in_memory_entries_expire() -> None:
    now = [0.0]
    store = InMemoryResponseStore(ttl_s=10, clock=lambda: now[0])
    first, second = record(), record()
    await store.put("default", first)
    now[0] = 5.0
    await store.put("default", second)
    now[0] = 10.0
    assert await store.get("default", first.response_id) is None  # expired
    assert await store.get("default", second.response_id) == second
    assert len(store) == 1


def capped(kind: str, prefix: str, *, max_entries: int, max_bytes: int) -> ResponseStore:
    if kind == "memory":
        return InMemoryResponseStore(max_entries=max_entries, max_bytes=max_bytes)
    return RedisResponseStore.from_url(
        REDIS_URL, ttl_s=TTL_S, key_prefix=prefix, max_entries=max_entries, max_bytes=max_bytes
    )


@pytest.mark.parametrize("kind", sorted(FACTORIES))
async def test_each_tenant_keeps_at_most_its_count_and_its_oldest_go_first(
    kind: str, redis_prefix: str
) -> None:
    store = capped(kind, redis_prefix, max_entries=2, max_bytes=1 << 20)
    try:
        flooder = [record() for _ in range(5)]
        other = record()
        await store.put("other", other)
        for kept in flooder:
            await store.put("flooder", kept)
        found = [await store.get("flooder", kept.response_id) for kept in flooder]
        assert found == [None, None, None, flooder[3], flooder[4]]
        assert await store.get("other", other.response_id) == other  # untouched by the flood
        assert await store.delete("flooder", flooder[4].response_id)
        await store.put("flooder", record())  # room for one more without dropping flooder[3]
        assert await store.get("flooder", flooder[3].response_id) == flooder[3]
    finally:
        await store.aclose()


@pytest.mark.parametrize("kind", sorted(FACTORIES))
async def test_each_tenant_keeps_at_most_its_bytes(kind: str, redis_prefix: str) -> None:
    size = len(record("x" * 1000).to_json().encode())
    store = capped(kind, redis_prefix, max_entries=100, max_bytes=3 * size)
    try:
        kept = [record("x" * 1000) for _ in range(5)]
        for one in kept:
            await store.put("t", one)
        found = [await store.get("t", one.response_id) is not None for one in kept]
        assert found == [False, False, True, True, True]
    finally:
        await store.aclose()


async def test_store_from_config_picks_redis_only_when_a_url_is_set(redis_prefix: str) -> None:
    in_memory = store_from_config(ResponsesConfig(), {})
    assert isinstance(in_memory, InMemoryResponseStore)
    for config, env in (
        (ResponsesConfig(redis_url=REDIS_URL, key_prefix=redis_prefix), {}),
        (ResponsesConfig(key_prefix=redis_prefix), {REDIS_URL_ENV: REDIS_URL}),  # the older variable
    ):
        shared = store_from_config(config, env)
        assert isinstance(shared, RedisResponseStore)
        assert shared.key("t", "resp_1").startswith(redis_prefix)
        await shared.aclose()


def codec_app(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend, store: ResponseStore
) -> httpx.AsyncClient:
    """A codec app whose responses go to `store`, as a replica behind a load balancer would."""
    app = make_app(tokenizer, fake, identity_for(model_dir))
    app.state.responses_store = store
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec")


@pytest.mark.model
async def test_two_codecs_share_conversations_through_redis(model_dir: Path, redis_prefix: str) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = FakeBackend(identity_for(model_dir).tokenizer_fingerprint, script=scripted([[19556]]))
    store_a, store_b = redis_store(redis_prefix), redis_store(redis_prefix)
    async with (
        codec_app(model_dir, tokenizer, fake, store_a) as replica_a,
        codec_app(model_dir, tokenizer, fake, store_b) as replica_b,
    ):
        first = await replica_a.post("/v1/responses", json={"model": MODEL_NAME, "input": "What is 2+2?"})
        response_id = first.json()["id"]
        assert (await replica_b.get(f"/v1/responses/{response_id}")).json() == first.json()
        body = {"model": MODEL_NAME, "input": "And 3+3?", "previous_response_id": response_id}
        second = await replica_b.post("/v1/responses", json=body)
        assert second.status_code == 200
        prompt = tokenizer.decode(fake.seen[-1].prompt_token_ids)
        assert "What is 2+2?" in prompt and "Hello" in prompt and "And 3+3?" in prompt
        assert (await replica_b.delete(f"/v1/responses/{response_id}")).status_code == 200
        assert (await replica_a.get(f"/v1/responses/{response_id}")).status_code == 404
    await store_a.aclose()
    await store_b.aclose()


class RecordingStore(InMemoryResponseStore):
    def __init__(self) -> None:
        super().__init__()
        self.is_closed = False

    async def aclose(self) -> None:
        self.is_closed = True


@pytest.mark.model
def test_the_store_is_closed_when_the_app_shuts_down(model_dir: Path) -> None:
    fake = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    app = make_app(Tokenizer.from_dir(model_dir), fake, identity_for(model_dir))
    store = RecordingStore()
    app.state.responses_store = store
    with serve_in_thread(app):
        assert response_store(app) is store
    assert store.is_closed and fake.is_closed


def test_install_takes_the_store_it_is_given() -> None:
    app = FastAPI()
    store = InMemoryResponseStore()
    install_responses(app, ResponsesConfig(), store)
    assert response_store(app) is store
