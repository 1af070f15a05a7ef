"""Optional mutual TLS for the internal gRPC hops (codec -> router -> workers, decode -> prefill KV).

Off unless `internal_tls.cert_file`, `key_file` and `ca_file` are all set (a partial setting is a config
error). When on, every internal server asks for and verifies a client certificate signed by the CA,
and every internal client presents its own certificate and verifies the server's against the same CA.
The files are read when a server or channel is made; rotate them by restarting (or rolling) the pods.
A client checks the server's certificate for the address it dials, or for `internal_tls.server_name`
when that is set: the router reaches workers at pod IPs, which one shared name can stand in for.
The internal bearer token stays required on top of TLS. The `torch` KV transport (gloo/NCCL) has no
TLS of its own: with internal TLS on, use the `grpc` transport, or keep pods on a private network.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import grpc

from services.common.config import TlsConfig
from services.common.errors import ConfigError

ChannelOptions = Sequence[tuple[str, int | str]]

# Keepalive on the internal hops: an idle or busy channel pings its peer every KEEPALIVE_TIME_MS and
# gives it KEEPALIVE_TIMEOUT_MS to answer, so a peer gone silent (a partition, a frozen process) is found in
# seconds and its calls fail UNAVAILABLE (the router then ejects and retries), not at the kernel's TCP
# timeout. The servers accept those pings, calls or none, and never answer them with GOAWAY
# too_many_pings.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000


def keepalive_options(
    time_ms: int = KEEPALIVE_TIME_MS, timeout_ms: int = KEEPALIVE_TIMEOUT_MS
) -> list[tuple[str, int | str]]:
    """A client channel's keepalive: ping every `time_ms`, with or without calls, and close the transport
    (its calls fail UNAVAILABLE) when a ping is not answered within `timeout_ms` (`ping_timeout_ms`:
    gRPC's keepalive timeout alone does not end a transport whose peer went silent)."""
    return [
        ("grpc.keepalive_time_ms", time_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    ]


def server_options(
    time_ms: int = KEEPALIVE_TIME_MS, timeout_ms: int = KEEPALIVE_TIMEOUT_MS
) -> list[tuple[str, int | str]]:
    """An internal server's keepalive: it pings idle clients too, and takes their pings (every
    `time_ms` at most, calls or none) without ever closing for too_many_pings."""
    return [
        ("grpc.keepalive_time_ms", time_ms),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", time_ms // 2),
        ("grpc.http2.max_ping_strikes", 0),  # 0: no limit, never GOAWAY too_many_pings
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
    ]


def is_enabled(tls: TlsConfig) -> bool:
    files = (tls.cert_file, tls.key_file, tls.ca_file)
    if any(files) and not all(files):
        raise ConfigError("internal_tls needs cert_file, key_file and ca_file together")
    return all(files)


def _read(path: str | None) -> bytes:
    if path is None:
        raise ConfigError("internal_tls file missing")
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"internal_tls: cannot read {path}: {exc.strerror}") from exc


def add_port(server: grpc.aio.Server, address: str, tls: TlsConfig) -> int:
    """Listen on `address`, with mutual TLS when it is configured."""
    if not is_enabled(tls):
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=_read(tls.ca_file),
        require_client_auth=True,
    )
    return server.add_secure_port(address, credentials)


def sync_credentials(tls: TlsConfig) -> grpc.ChannelCredentials:
    """Client credentials: our certificate, and the CA that signs the servers'."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file),
        private_key=_read(tls.key_file),
        certificate_chain=_read(tls.cert_file),
    )


def client_options(tls: TlsConfig, options: ChannelOptions = ()) -> list[tuple[str, int | str]]:
    """`options`, plus the name to check the server's certificate for when `internal_tls.server_name`
    is set (the address dialled otherwise)."""
    if tls.server_name is None:
        return list(options)
    return [*options, ("grpc.ssl_target_name_override", tls.server_name)]


def channel(address: str, tls: TlsConfig, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """An async channel to an internal service, presenting our certificate when TLS is on, with keepalive
    (`keepalive_options`; an option given in `options` wins)."""
    merged = list({**dict(keepalive_options()), **dict(options)}.items())
    if not is_enabled(tls):
        return grpc.aio.insecure_channel(address, options=merged)
    return grpc.aio.secure_channel(address, sync_credentials(tls), options=client_options(tls, merged))
