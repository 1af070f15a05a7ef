"""Redis clients from one URL, a single server or a primary that Sentinel watches and fails over.

Every part that keeps state in Redis (quotas, stored Responses, the async lane's queue, the result cache,
the shared KV tier) makes its client here, so each takes either form:

    redis://[:password@]host:6379/0            one server; rediss:// for TLS (redis-py's own URL rules)
    redis+sentinel://[:password@]s1:26379,s2:26379,s3:26379/<service>[/<db>]
    rediss+sentinel://...                      the same with TLS to the Sentinels and the primary

With Sentinel the client asks the Sentinels (in order, the first that answers) for the primary of
`<service>` at each new connection, so after a failover the next command reaches the promoted replica: a
connection to a primary that died fails (the caller's usual Redis-down path for that one command: the
quota fallback, a 503), and one to a primary that came back demoted answers READONLY, which the client
turns into a reconnect. The user and password in the
URL are the primary's (percent-encoded); Sentinels that want a password of their own take
`?sentinel_password=...`. With TLS, `?ssl_ca_certs=<file>` names the CA both are checked against, and
their certificates must name the host names the Sentinels announce.
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
    username: str | None
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
    rest = rest.partition("#")[0]
    location, _, query_text = rest.partition("?")
    netloc, _, path = location.partition("/")
    userinfo, _, hosts = netloc.rpartition("@")
    username, _, password = (urllib.parse.unquote(part) for part in userinfo.partition(":"))
    sentinels = [_host_port(host.strip()) for host in hosts.split(",")]
    parts = [p for p in path.split("/") if p]
    if not parts or len(parts) > 2 or (len(parts) == 2 and not parts[1].isdigit()):
        raise ConfigError("a Sentinel URL's path is /<service name>[/<db number>]")
    query: dict[str, str] = {}
    for pair in filter(None, query_text.split("&")):  # percent-decoded only: "+" is a plus, as in userinfo
        key, _, value = pair.partition("=")
        query[urllib.parse.unquote(key)] = urllib.parse.unquote(value)
    unknown = set(query) - {"sentinel_password", "ssl_ca_certs"}
    if unknown:
        raise ConfigError(f"a Sentinel URL takes sentinel_password and ssl_ca_certs, not {sorted(unknown)}")
    return SentinelTarget(
        sentinels=sentinels,
        service=urllib.parse.unquote(parts[0]),
        db=int(parts[1]) if len(parts) == 2 else 0,
        username=username or None,
        password=password or None,
        sentinel_password=query.get("sentinel_password"),
        tls=SENTINEL_SCHEMES[scheme.lower()],
        ssl_ca_certs=query.get("ssl_ca_certs"),
    )


def _host_port(host: str) -> tuple[str, int]:
    """host, host:port, [v6] or [v6]:port."""
    if host.startswith("["):
        name, _, tail = host[1:].partition("]")
        port = tail.removeprefix(":")
    elif host.count(":") == 1:
        name, _, port = host.partition(":")
    else:
        name, port = host, ""
    if not name or (":" in name and not host.startswith("[")) or (port and not port.isdigit()):
        raise ConfigError(
            f"a Sentinel URL's hosts are host[:port] or [v6][:port], comma-separated; got {host!r}"
        )
    return name, int(port) if port else DEFAULT_SENTINEL_PORT


def _sentinel_kwargs(
    target: SentinelTarget, options: dict[str, Any], retry_class: Any
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Sentinels' own connection settings and the primary's. Asking a Sentinel keeps the caller's
    socket timeouts and never retries (the next Sentinel in the list is the retry), so one dead or silent
    Sentinel costs a call at most its timeout; the primary gets the caller's retry, else one at once (a
    connection a failover closed)."""
    from redis.backoff import NoBackoff

    tls = {"ssl": True, "ssl_ca_certs": target.ssl_ca_certs} if target.tls else {}
    sentinel = {k: v for k, v in options.items() if k.startswith("socket_")}
    sentinel.update(tls, password=target.sentinel_password, retry=retry_class(NoBackoff(), 0))
    primary = {"retry": retry_class(NoBackoff(), 1), **options, **tls, "db": target.db}
    if options.get("password") is None:
        primary["password"] = target.password
    if target.username and "username" not in options:
        primary["username"] = target.username
    return sentinel, primary


def async_client(url: str, **options: Any) -> Any:
    """A redis.asyncio client for `url`, either form; `options` go to every connection to the primary."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.asyncio.sentinel import Sentinel

    return _client(url, aioredis.Redis, Sentinel, Retry, options)


def sync_client(url: str, **options: Any) -> Any:
    """A blocking redis client for `url`, either form (the workers' shared KV tier)."""
    import redis
    from redis.retry import Retry
    from redis.sentinel import Sentinel

    return _client(url, redis.Redis, Sentinel, Retry, options)


def _client(
    url: str, redis_class: Any, sentinel_class: Any, retry_class: Any, options: dict[str, Any]
) -> Any:
    if not is_sentinel(url):
        return redis_class.from_url(url, **options)
    target = parse_sentinel_url(url)
    sentinel_kwargs, primary = _sentinel_kwargs(target, options, retry_class)
    return sentinel_class(target.sentinels, sentinel_kwargs=sentinel_kwargs).master_for(
        target.service, **primary
    )
