"""TLS at the entry: the codec's HTTPS and public gRPC ports, with a certificate rotated without a restart.

`server.tls.cert_file` and `key_file` (PEM; the chart mounts a `kubernetes.io/tls` Secret) are read at start
(a missing, unreadable or mismatched pair is a ConfigError) and then every `reload_interval_s`. Kubernetes
updates a mounted Secret by swapping the directory's `..data` symlink, so the files are compared by what
they hold, read through their resolved paths (one consistent generation of the Secret), never by a
watched inode. A new pair is loaded only after it proves to match (the key is the certificate's); a pair
caught half-written stays out, and the previous one keeps serving until the next check.

Both listeners pick the new pair up for new connections while established ones carry on:
- HTTP (uvicorn): a fresh `ssl.SSLContext` is built from each new pair, and the listening context's
  server-name callback, which runs at every handshake (with or without SNI), hands the handshake the
  current one; a context is never changed while in use, so no handshake sees a half-loaded pair;
- gRPC: the server's credentials are gRPC's dynamic server credentials, whose fetcher, called at each
  handshake, hands over the new pair once per change.
Clients present no certificate (the API key authenticates them).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.config import EntryTlsConfig
from services.common.errors import ConfigError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Pair:
    cert_pem: bytes
    key_pem: bytes
    cert_path: str  # the resolved paths they were read from
    key_path: str

    @property
    def fingerprint(self) -> str:
        """sha256 of the certificate file: names the generation in logs (no secret in it)."""
        return hashlib.sha256(self.cert_pem).hexdigest()[:16]


def _read_pair(cert_file: str, key_file: str) -> _Pair:
    """Reads one pair through its resolved paths; raises OSError when a file is missing."""
    cert_path, key_path = os.path.realpath(cert_file), os.path.realpath(key_file)
    return _Pair(Path(cert_path).read_bytes(), Path(key_path).read_bytes(), cert_path, key_path)


def _server_context(pair: _Pair) -> ssl.SSLContext:
    """A server context (TLS 1.2 or later) for `pair`; raises ssl.SSLError (or OSError) when the key is not
    the certificate's or the files changed under it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(pair.cert_path, pair.key_path)
    return context


class ReloadingCertificate:
    """One certificate and key on disk, served by the codec's HTTPS and gRPC listeners, re-read on change."""

    def __init__(self, config: EntryTlsConfig) -> None:
        if not (config.cert_file and config.key_file):
            raise ConfigError("server.tls needs both cert_file and key_file")
        self.cert_file, self.key_file = config.cert_file, config.key_file
        self.interval_s = config.reload_interval_s
        try:
            self._pair = _read_pair(self.cert_file, self.key_file)
            self._context = _server_context(self._pair)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"server.tls: cannot load {self.cert_file} with {self.key_file}: {exc}"
            ) from None
        self.generation = 0  # bumped by each pair loaded after the first
        self._grpc_generation = 0  # the generation the gRPC fetcher last handed over

    @property
    def fingerprint(self) -> str:
        return self._pair.fingerprint

    def server_context(self) -> ssl.SSLContext:
        """The listening context for HTTPS, the first pair's (nothing read again): each handshake gets the
        current pair's context from its server-name callback."""
        context = self._context
        context.sni_callback = self._select
        return context

    def _select(self, connection: ssl.SSLObject, server_name: str | None, listening: ssl.SSLContext) -> None:
        connection.context = self._context

    def grpc_credentials(self) -> Any:
        """gRPC server credentials that take each new pair at the next handshake."""
        import grpc

        return grpc.dynamic_ssl_server_credentials(
            self._grpc_configuration(), self._fetch_for_grpc, require_client_authentication=False
        )

    def _grpc_configuration(self) -> Any:
        import grpc

        return grpc.ssl_server_certificate_configuration([(self._pair.key_pem, self._pair.cert_pem)])

    def _fetch_for_grpc(self) -> Any:
        # gRPC calls this at every handshake, from its own thread: cheap unless the pair changed.
        generation = self.generation
        if generation == self._grpc_generation:
            return None
        self._grpc_generation = generation
        return self._grpc_configuration()

    def check(self) -> bool:
        """Re-reads the files; loads a new, matching pair and returns True. A pair that cannot be read or
        does not match is logged and left for the next check (the current one keeps serving). An unchanged
        pair costs two reads: a context is built only for a new one."""
        try:
            pair = _read_pair(self.cert_file, self.key_file)
            if (pair.cert_pem, pair.key_pem) == (self._pair.cert_pem, self._pair.key_pem):
                return False
            context = _server_context(pair)
        except (OSError, ssl.SSLError) as exc:
            logger.warning("entry TLS: the certificate on disk cannot be loaded yet: %s", exc)
            return False
        self._pair, self._context = pair, context
        self.generation += 1
        logger.info("entry TLS: certificate reloaded", extra={"certificate_sha256": pair.fingerprint})
        return True

    async def watch(self) -> None:
        """Checks every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.check()
            except Exception as exc:  # a watcher must not die: the next check tries again
                logger.warning("entry TLS: reload failed: %s", type(exc).__name__, exc_info=exc)
