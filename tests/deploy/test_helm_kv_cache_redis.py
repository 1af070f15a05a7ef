"""The KV tiers' cache Redis as the chart renders it (password, TLS only), run here as a local redis-server
(tests/deploy/local_redis.py), and reached through the workers' rendered URL and password with the shared
tier's own client (services/kvcache/redis_tier.py): segments go in and come back, the eviction policy,
maxmemory and persistence are what the role needs, a wrong password and plaintext are refused, and its
readiness probe answers.
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
