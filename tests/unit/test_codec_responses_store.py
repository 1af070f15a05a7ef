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
    store_from_env,
)
from services.codec.text.tokenizer import Tokenizer
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


async def test_in_memory_entries_expire_and_the_oldest_are_evicted() -> None:
    now = [0.0]
    store = InMemoryResponseStore(ttl_s=10, max_entries=2, clock=lambda: now[0])
    first, second, third = record(), record(), record()
    for kept in (first, second, third):
        await store.put("default", kept)
    assert await store.get("default", first.response_id) is None  # evicted: over max_entries
    assert await store.get("default", third.response_id) == third
    now[0] = 10.0
    assert await store.get("default", second.response_id) is None  # expired
    assert len(store) == 1


async def test_store_from_env_picks_redis_only_when_the_url_is_set() -> None:
    in_memory = store_from_env({})
    assert isinstance(in_memory, InMemoryResponseStore)
    shared = store_from_env({REDIS_URL_ENV: REDIS_URL})
    assert isinstance(shared, RedisResponseStore)
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
    install_responses(app, store)
    assert response_store(app) is store
