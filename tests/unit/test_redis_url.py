"""Redis URLs (services/common/redis_url.py): redis+sentinel:// names the Sentinels, the service they watch,
the database and the passwords; a malformed one is a ConfigError naming the part at fault; a plain
redis:// URL stays redis-py's."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import NoBackoff

from services.common.errors import ConfigError
from services.common.redis_url import async_client, parse_sentinel_url, sync_client


def test_a_sentinel_url_names_sentinels_service_db_and_passwords() -> None:
    target = parse_sentinel_url(
        "redis+sentinel://:p%40ss@s1:26380,s2,[::1]:26381/kvrelay/1?sentinel_password=sp"
    )
    assert target.sentinels == [("s1", 26380), ("s2", 26379), ("::1", 26381)]
    assert (target.service, target.db, target.password, target.sentinel_password) == (
        "kvrelay",
        1,
        "p@ss",
        "sp",
    )
    assert target.tls is False
    tls = parse_sentinel_url("rediss+sentinel://s1/kvrelay?ssl_ca_certs=/etc/ca.crt#ignored")
    assert (tls.db, tls.password, tls.tls, tls.ssl_ca_certs) == (0, None, True, "/etc/ca.crt")
    assert tls.service == "kvrelay"  # a fragment is no part of the service name
    plus = parse_sentinel_url("redis+sentinel://app:a+b@[::1]/kvrelay?sentinel_password=a+b")
    assert (plus.username, plus.password, plus.sentinel_password) == ("app", "a+b", "a+b")  # "+" is a plus
    assert plus.sentinels == [("::1", 26379)]


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://s1:26379", "path is /<service name>"),
        ("redis+sentinel://s1/kvrelay/one", "path is /<service name>"),
        ("redis+sentinel://s1:x/kvrelay", "host[:port]"),
        ("redis+sentinel://s1/kvrelay?db=2", "not ['db']"),
        ("redis+sentinel://::1/kvrelay", "host[:port] or [v6]"),
        ("redis+sentinel:///kvrelay", "host[:port] or [v6]"),
    ],
)
def test_a_malformed_sentinel_url_is_a_config_error(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_sentinel_url(url)


def test_clients_follow_the_sentinels_or_talk_to_one_server() -> None:
    client = async_client(
        "redis+sentinel://:pw@s1:26379/kvrelay/2", socket_timeout=1.0, decode_responses=True
    )
    pool = client.connection_pool
    assert isinstance(pool, SentinelConnectionPool) and pool.service_name == "kvrelay"
    assert pool.connection_kwargs["db"] == 2 and pool.connection_kwargs["password"] == "pw"
    plain = async_client("redis://127.0.0.1:6379/3")
    assert isinstance(plain, aioredis.Redis) and plain.connection_pool.connection_kwargs["db"] == 3
    blocking = sync_client("redis+sentinel://s1/kvrelay", password="from-env")
    assert blocking.connection_pool.connection_kwargs["password"] == "from-env"


def test_a_silent_sentinel_costs_its_timeout_once_and_the_primary_retries_once() -> None:
    client = async_client("redis+sentinel://:pw@s1,s2/kvrelay?sentinel_password=sp", socket_timeout=0.5)
    manager = client.connection_pool.sentinel_manager
    for sentinel in manager.sentinels:  # no retry per Sentinel: the next one in the list is the retry
        kwargs = sentinel.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.5 and kwargs["password"] == "sp"
        assert kwargs["retry"].get_retries() == 0
    assert client.connection_pool.connection_kwargs["retry"].get_retries() == 1
    assert isinstance(client.connection_pool.connection_kwargs["retry"], Retry)  # the asyncio one
    blocking = sync_client("redis+sentinel://s1/kvrelay").connection_pool.connection_kwargs["retry"]
    assert not isinstance(blocking, Retry) and blocking.get_retries() == 1
    chosen = Retry(NoBackoff(), 3)
    assert (
        async_client("redis+sentinel://s1/k", retry=chosen).connection_pool.connection_kwargs["retry"]
        is chosen
    )
