"""Redis clients from one URL, a single server or a primary that Sentinel watches and fails over.

Every part that keeps state in Redis (quotas, stored Responses, the async lane's queue, the result cache,
the shared KV tier) makes its client here, so each takes either form:

    redis://[:password@]host:6379/0            one server; rediss:// for TLS (redis-py's own URL rules)
    redis+sentinel://[:password@]s1:26379,s2:26379,s3:26379/<service>[/<db>]
    rediss+sentinel://...                      the same with TLS to the Sentinels and the primary

With Sentinel the client asks the Sentinels for the primary of `<service>` at each new connection, so after
a failover the next command reaches the promoted replica: a connection to a primary that died fails (the
caller's usual Redis-down path for that one command: the quota fallback, a 503), and one to a primary that
came back demoted answers READONLY, which the client turns into a reconnect. The password in the URL is
the primary's; Sentinels that want one of their own take `?sentinel_password=...`. With TLS,
`?ssl_ca_certs=<file>` names the CA both are checked against.
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any

from services.common.errors import ConfigError

SENTINEL_SCHEMES = {"redis+sentinel": False, "rediss+sentinel": True}  # scheme -> TLS
DEFAULT_SENTINEL_PORT = 26379


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: list[tuple[str, int]]
    service: str
    db: int
    password: str | None
    sentinel_password: str | None
    tls: bool
    ssl_ca_certs: str | None


def is_sentinel(url: str) -> bool:
    return url.split("://", 1)[0].lower() in SENTINEL_SCHEMES


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The parts of a redis+sentinel:// URL; a ConfigError names what is wrong (never the password)."""
    scheme, _, rest = url.partition("://")
    if scheme.lower() not in SENTINEL_SCHEMES:
        raise ConfigError(f"not a Sentinel URL: scheme {scheme!r}")
    location, _, query_text = rest.partition("?")
    netloc, _, path = location.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    password = urllib.parse.unquote(userinfo.partition(":")[2]) if userinfo else None
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.strip().rpartition(":") if ":" in host else (host.strip(), "", "")
        if not name or (port and not port.isdigit()):
            raise ConfigError(f"a Sentinel URL's hosts are host[:port],...; got {host.strip()!r}")
        sentinels.append((name.strip("[]"), int(port) if port else DEFAULT_SENTINEL_PORT))
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError("a Sentinel URL's path is /<service name>[/<db number>]")
    query = urllib.parse.parse_qs(query_text)
    unknown = set(query) - {"sentinel_password", "ssl_ca_certs"}
    if unknown:
        raise ConfigError(f"a Sentinel URL takes sentinel_password and ssl_ca_certs, not {sorted(unknown)}")
    return SentinelTarget(
        sentinels=sentinels,
        service=urllib.parse.unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        password=password or None,
        sentinel_password=query.get("sentinel_password", [None])[0],
        tls=SENTINEL_SCHEMES[scheme.lower()],
        ssl_ca_certs=query.get("ssl_ca_certs", [None])[0],
    )


def _sentinel_kwargs(
    target: SentinelTarget, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Sentinels' own connection settings and the primary's."""
    tls = {"ssl": True, "ssl_ca_certs": target.ssl_ca_certs} if target.tls else {}
    sentinel = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinel.update(tls, password=target.sentinel_password)
    primary = {**options, **tls, "db": target.db}
    if options.get("password") is None:
        primary["password"] = target.password
    return sentinel, primary


def async_client(url: str, **options: Any) -> Any:
    """A redis.asyncio client for `url`, either form; `options` go to every connection to the primary."""
    import redis.asyncio as aioredis
    from redis.asyncio.sentinel import Sentinel

    return _client(url, aioredis.Redis, Sentinel, options)


def sync_client(url: str, **options: Any) -> Any:
    """A blocking redis client for `url`, either form (the workers' shared KV tier)."""
    import redis
    from redis.sentinel import Sentinel

    return _client(url, redis.Redis, Sentinel, options)


def _client(url: str, redis_class: Any, sentinel_class: Any, options: dict[str, Any]) -> Any:
    if not is_sentinel(url):
        return redis_class.from_url(url, **options)
    target = parse_sentinel_url(url)
    sentinel_kwargs, primary = _sentinel_kwargs(target, options)
    return sentinel_class(target.sentinels, sentinel_kwargs=sentinel_kwargs).master_for(
        target.service, **primary
    )
