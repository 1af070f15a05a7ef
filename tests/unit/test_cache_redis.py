"""The KV cache's own Redis that `kvrelay up` starts (services/common/cache_redis.py): only for a URL on this
machine where nothing answers, run as a cache (LRU, no persistence), stopped with the stack, and refused
with the fix when redis-server is missing."""

from __future__ import annotations

import pytest
import redis

from services.common import cache_redis
from services.common.cache_redis import CacheRedisError, answers, local_cache_redis, local_port
from tests.ports import free_port


def test_only_a_plain_url_on_this_machine_is_ours_to_start() -> None:
    assert local_port("redis://127.0.0.1:6390/0") == 6390
    assert local_port("redis://localhost/0") == 6379
    assert local_port("rediss://127.0.0.1:6390/0") is None  # TLS: the operator's
    assert local_port("redis://cache.example:6379/0") is None


def test_up_starts_a_cache_redis_where_nothing_answers_and_stops_it_after() -> None:
    port = free_port()
    with local_cache_redis(f"redis://127.0.0.1:{port}/0", "s3cret") as started:
        assert started == port
        client = redis.Redis(port=port, password="s3cret")
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
        assert (
            client.config_get("save") == {"save": ""}
            and client.config_get("appendonly")["appendonly"] == "no"
        )
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        with local_cache_redis(f"redis://127.0.0.1:{port}/0", None) as again:
            assert again is None  # something answers there now: nothing more is started
    assert not answers(port)


def test_without_redis_server_up_refuses_and_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache_redis.shutil, "which", lambda _: None)
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(CacheRedisError, match="apt install redis-server"), local_cache_redis(url, None):
        pass
