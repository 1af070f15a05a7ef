"""The KV tiers' cache Redis as the chart renders it (password, TLS only), run here as a local redis-server
(tests/deploy/local_redis.py), and reached through the workers' rendered URL and password with the shared
tier's own client (services/kvcache/redis_tier.py): segments go in and come back, the eviction policy,
maxmemory and persistence are what the role needs, a wrong password and plaintext are refused, and its
readiness probe answers. The codec, keeping the exact-result cache there (config.result_cache.tenants),
reaches it through its own rendered URL, password and CA with its own client (codec/backend/results.py).
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import local_redis
from tests.deploy.chart import container, env_of, fullname, one, render
from tests.tls_certs import make_certs

VALUES = {
    "gpu": {"enabled": False},
    "internalTls": {"enabled": True, "existingSecret": "kvrelay-internal-tls"},
    "kvTiers": {"enabled": True, "cacheRedis": {"maxMemory": "6gb", "tls": {"enabled": True}}},
    "config": {"result_cache": {"tenants": ["*"]}},
}


@pytest.fixture
def cache_redis(tmp_path: Path) -> Iterator[tuple[list[dict], int, Path, str]]:
    """The rendered cache Redis running here: objects, port, local CA dir, password."""
    objects = render(VALUES)
    secret = one(objects, "Secret", fullname("kv-cache-auth"))
    password = base64.b64decode(secret["data"]["password"]).decode()
    certs = make_certs(tmp_path / "certs", san="IP:127.0.0.1,DNS:localhost")
    local_tls = local_redis.secret_dir(certs, tmp_path / "tls")
    with local_redis.running(container(objects, "kv-cache"), password, local_tls, tmp_path) as port:
        yield objects, port, local_tls, password


def test_workers_store_and_read_segments_in_the_rendered_cache_redis(
    cache_redis: tuple[list[dict], int, Path, str],
) -> None:
    from services.kvcache.redis_tier import RedisTier
    from services.kvcache.tier import TierUnavailable

    objects, port, local_tls, password = cache_redis
    url = env_of(container(objects, "decode"))["KVRELAY_KV_TIERS__SHARED_URL"]["value"]
    url = url.replace(f"{fullname('kv-cache')}:6379", f"127.0.0.1:{port}")
    url = url.replace("/etc/kvrelay/kv-cache-tls", str(local_tls))
    tier = RedisTier.from_url(url, ttl_s=60, timeout_s=2.0, password=password)  # as the worker builds it
    key = "kv1:0123456789abcdef:-:" + "ab" * 16
    assert tier.put(key, b"segment") and tier.get(key) == b"segment"
    settings = ("maxmemory", "maxmemory-policy", "save", "appendonly")
    config = {k: v for name in settings for k, v in tier.client.config_get(name).items()}
    assert config == {
        "maxmemory": str(6 * 2**30),
        "maxmemory-policy": "allkeys-lru",
        "save": "",
        "appendonly": "no",
    }
    with pytest.raises(TierUnavailable):  # a wrong password
        RedisTier.from_url(url, ttl_s=60, timeout_s=2.0, password="wrong").get(key)
    plaintext = f"redis://127.0.0.1:{port}/0"
    with pytest.raises(TierUnavailable):  # no plaintext port
        RedisTier.from_url(plaintext, ttl_s=60, timeout_s=1.0, password=password).get(key)
    result = local_redis.readiness_probe(container(objects, "kv-cache"), port, password, local_tls)
    assert result.returncode == 0 and result.stdout.strip() == "PONG", result


async def test_the_codec_keeps_results_in_the_rendered_cache_redis(
    cache_redis: tuple[list[dict], int, Path, str],
) -> None:
    from services.codec.backend.protocol import TokenDelta
    from services.codec.backend.results import ResultCache
    from services.codec.metrics import CodecMetrics
    from services.common.config import KV_TIERS_PASSWORD_ENV, load_config
    from services.common.outputs import FinishReason

    objects, port, local_tls, password = cache_redis
    env = env_of(container(objects, "codec"))
    assert (
        env[KV_TIERS_PASSWORD_ENV]["valueFrom"]
        == env_of(container(objects, "decode"))[KV_TIERS_PASSWORD_ENV]["valueFrom"]
    )
    url = env["KVRELAY_KV_TIERS__SHARED_URL"]["value"]
    url = url.replace(f"{fullname('kv-cache')}:6379", f"127.0.0.1:{port}")
    url = url.replace("/etc/kvrelay/kv-cache-tls", str(local_tls))
    overrides = {
        "KVRELAY_KV_TIERS__SHARED_URL": url,
        "KVRELAY_RESULT_CACHE__TENANTS": "['*']",
        "KVRELAY_RESULT_CACHE__TIMEOUT_MS": "10000",  # what is stored is checked here, not how fast
    }
    config = load_config(None, env=overrides)
    delta = TokenDelta(0, [5, 6], [], FinishReason.STOP, 3, 0)
    cache = ResultCache.from_config(config, CodecMetrics().result_cache, {KV_TIERS_PASSWORD_ENV: password})
    assert cache is not None and cache.admits("anyone")
    cache.store_later("ab" * 32, "t", [delta])
    await cache.drain()
    assert cache.metrics.errors.labels(operation="put")._value.get() == 0
    got = await cache.lookup("ab" * 32, "t")
    assert got is not None and got[0].token_ids == [5, 6] and got[0].num_cached_tokens == 3
    await cache.aclose()
    wrong = ResultCache.from_config(config, CodecMetrics().result_cache, {KV_TIERS_PASSWORD_ENV: "wrong"})
    assert wrong is not None and await wrong.lookup("ab" * 32, "t") is None  # refused: a miss
    assert wrong.metrics.errors.labels(operation="get")._value.get() == 1
    await wrong.aclose()
