"""API keys: who a request is for (docs/admission.md).

A key looks like `kvr-<key_id>-<secret>`. The keys file (`auth.keys_file`, YAML or JSON) lists
`keys: [{key_id, tenant, sha256, created, admin, cache_retention_24h, priority_tier}]`: the SHA-256 of
each whole key, never the key itself. An `admin` key may also read /status (internal addresses and
load); with keys configured, no other may. A `cache_retention_24h` key may ask for OpenAI's
`prompt_cache_retention: "24h"`; a `priority_tier` key for the high priority class (`service_tier:
"priority"`, docs/priority.md).
`kvrelay keys add | list | revoke` (services/cli/keys.py) writes it.

A request presents its key as `Authorization: Bearer <key>` (OpenAI's SDKs) or `x-api-key: <key>`
(Anthropic's); on the public gRPC API, as the same two metadata keys. The key ID names at most one
record, and the key's digest is compared with that record's by `hmac.compare_digest` (an unknown key ID
is compared against a dummy digest, so both failures take the same path). A missing or wrong key is a
401 in the route's protocol shape (UNAUTHENTICATED on gRPC); the key itself is never logged or echoed.

The file is re-read when its mtime, size or inode changes, checked at most once a second on the request
path, so keys are added and revoked without a restart. A file that turns unreadable or invalid keeps the
last good set (and logs an error); it must be valid when the codec starts.

Without `auth.keys_file` the codec runs in open mode: every request is the tenant "default". The probe
and scrape paths (/health, /ready, /metrics) and gRPC health are open in every mode.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, StringConstraints, ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from services.codec.admission.tenancy import CALL_TENANT, JOB_TENANT
from services.codec.errors import AuthenticationError, describe, error_response
from services.codec.metrics import CodecMetrics, RequestStats
from services.codec.middleware import header
from services.common.config import AuthConfig
from services.common.errors import ConfigError
from services.common.tenants import Tenant, cache_salt, open_tenant

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvr"
KEY_ID_BYTES = 6  # 12 hex characters: the public half, in logs and `kvrelay keys list`
SECRET_BYTES = 32
RELOAD_INTERVAL_S = 1.0
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})  # probes and scrapes: never behind a key
AUTHORIZATION = "authorization"
X_API_KEY = "x-api-key"
KEY_ID_PATTERN = r"^[A-Za-z0-9]{1,64}$"
TENANT_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$"
_DUMMY_DIGEST = hashlib.sha256(b"kvrelay: no such key").digest()


class KeyRecord(BaseModel):
    """One key in the keys file: its public ID, its tenant and the SHA-256 (hex) of the whole key."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key_id: Annotated[str, StringConstraints(pattern=KEY_ID_PATTERN)]
    tenant: Annotated[str, StringConstraints(pattern=TENANT_PATTERN)]
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    created: str = ""
    admin: bool = False  # may read /status (the stack's addresses and load), beside its tenant's API
    cache_retention_24h: bool = False  # may ask for prompt_cache_retention "24h" (docs/protocols.md)
    priority_tier: bool = False  # may ask for the high priority class (docs/priority.md)


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    keys: list[KeyRecord] = []


def new_key() -> tuple[str, str]:
    """(key ID, key) for a fresh key: `kvr-<12 hex>-<43 url-safe characters>`."""
    key_id = secrets.token_hex(KEY_ID_BYTES)
    return key_id, f"{KEY_PREFIX}-{key_id}-{secrets.token_urlsafe(SECRET_BYTES)}"


def key_digest(key: str) -> str:
    """The hex SHA-256 of the whole key, as the keys file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


def key_id_of(key: str) -> str | None:
    """The key ID a well-formed key names, else None. The secret may hold '-', the ID may not."""
    prefix, _, rest = key.partition("-")
    key_id, _, secret = rest.partition("-")
    if prefix != KEY_PREFIX or not secret or not re.fullmatch(KEY_ID_PATTERN, key_id):
        return None
    return key_id


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_keys_file(path: Path) -> list[KeyRecord]:
    """The records in `path`; a ConfigError naming the file when it cannot be read or is invalid."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"keys file {path} cannot be read: {exc}") from None
    try:
        data = yaml.safe_load(text)  # YAML 1.1 reads JSON too
    except yaml.YAMLError as exc:
        raise ConfigError(f"keys file {path} is not valid YAML or JSON: {exc}") from None
    try:
        records = KeysFile.model_validate({} if data is None else data).keys
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in error['loc']) or '(top)'}: {error['msg']}"
            for error in exc.errors(include_url=False)
        )
        raise ConfigError(f"keys file {path} is invalid: {problems}") from None
    seen: set[str] = set()
    for record in records:
        if record.key_id in seen:
            raise ConfigError(f"keys file {path} lists key ID {record.key_id} twice")
        seen.add(record.key_id)
    return records


def write_keys_file(path: Path, records: Sequence[KeyRecord]) -> None:
    """Replaces `path` atomically (a reader sees the old file or the new one), mode 0600. JSON when the
    name ends in .json, else YAML."""
    document: dict[str, Any] = {"keys": [record.model_dump() for record in records]}
    if path.suffix.lower() == ".json":
        text = json.dumps(document, indent=2) + "\n"
    else:
        header = "# kvrelay API keys (kvrelay keys add | list | revoke): SHA-256 digests only, no key.\n"
        text = header + yaml.safe_dump(document, sort_keys=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as tmp:
            tmp.write(text)
            tmp.flush()
            os.fsync(tmp.fileno())
        os.chmod(tmp_name, 0o600)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class _Entry:
    digest: bytes
    tenant: Tenant


class KeyStore:
    """The keys of one keys file, re-read when the file changes (checked at most every `interval_s`)."""

    def __init__(
        self,
        path: Path,
        shared_groups: Sequence[Sequence[str]] = (),
        *,
        interval_s: float = RELOAD_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._shared_groups = [list(group) for group in shared_groups]
        self._interval_s = interval_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._signature: tuple[int, int, int] | None = None
        self._checked_at = 0.0
        self._load(self._stat())  # a missing or invalid file at startup is a ConfigError

    @property
    def num_keys(self) -> int:
        return len(self._entries)

    def tenant_for(self, key: str) -> Tenant | None:
        """The tenant `key` authenticates as, or None. Constant time in the key's secret."""
        self.refresh()
        key_id = key_id_of(key)
        entry = self._entries.get(key_id) if key_id is not None else None
        given = hashlib.sha256(key.encode()).digest()
        is_match = hmac.compare_digest(given, entry.digest if entry is not None else _DUMMY_DIGEST)
        return entry.tenant if entry is not None and is_match else None

    def tenant_by_key_id(self, key_id: str) -> Tenant | None:
        """The tenant of the key with this public ID while the key stands (None once revoked): queued
        work runs with the permissions of the key that made it (services/codec/lane/drainer.py)."""
        self.refresh()
        entry = self._entries.get(key_id)
        return entry.tenant if entry is not None else None

    def refresh(self, *, force: bool = False) -> None:
        """Re-reads the file if it changed; looks at most once per interval unless `force`."""
        now = self._clock()
        if not force and now - self._checked_at < self._interval_s:
            return
        self._checked_at = now
        try:
            signature = self._stat()
        except ConfigError as exc:
            if self._signature is not None:
                logger.error("API keys file unavailable, keeping the last good keys: %s", exc)
                self._signature = None
            return
        if signature == self._signature:
            return
        try:
            self._load(signature)
        except ConfigError as exc:
            logger.error("API keys file invalid, keeping the last good keys: %s", exc)
            self._signature = signature  # report each bad version once
            return
        logger.info("API keys reloaded", extra={"keys_file": str(self.path), "num_keys": self.num_keys})

    def _stat(self) -> tuple[int, int, int]:
        try:
            st = self.path.stat()
        except OSError as exc:
            raise ConfigError(f"keys file {self.path} cannot be read: {exc}") from None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def _load(self, signature: tuple[int, int, int]) -> None:
        records = read_keys_file(self.path)
        self._entries = {
            record.key_id: _Entry(
                bytes.fromhex(record.sha256),
                Tenant(
                    record.tenant,
                    record.key_id,
                    cache_salt(record.tenant, self._shared_groups),
                    is_admin=record.admin,
                    may_retain_24h=record.cache_retention_24h,
                    may_use_priority=record.priority_tier,
                ),
            )
            for record in records
        }
        self._signature = signature


class Authenticator:
    """Open mode (no key store: everyone is the tenant "default") or key checks against a KeyStore."""

    def __init__(self, store: KeyStore | None, shared_groups: Sequence[Sequence[str]] = ()) -> None:
        self.store = store
        self._open_tenant = open_tenant(shared_groups)

    @classmethod
    def from_config(cls, config: AuthConfig) -> Authenticator:
        """Loads the keys file named by the config (a ConfigError if it is missing or invalid)."""
        groups = config.shared_cache_groups
        if config.keys_file is None:
            return cls(None, groups)
        return cls(KeyStore(Path(config.keys_file), groups), groups)

    @property
    def is_open(self) -> bool:
        return self.store is None

    def tenant_of_key(self, key_id: str | None) -> Tenant | None:
        """The tenant of a key by its public ID (the open tenant in open mode); None once revoked."""
        if self.store is None:
            return self._open_tenant
        return self.store.tenant_by_key_id(key_id) if key_id is not None else None

    def authenticate(self, authorization: str | None, api_key: str | None) -> Tenant:
        """The tenant for a request's `Authorization` and `x-api-key` values; AuthenticationError if
        neither holds a valid key. When both are sent they must carry the same key."""
        if self.store is None:
            return self._open_tenant
        key = presented_key(authorization, api_key)
        tenant = self.store.tenant_for(key)
        if tenant is None:
            raise AuthenticationError(is_missing=False)
        return tenant


def rpc_tenant() -> Tenant:
    """The tenant of the running public gRPC call, set by its auth interceptor (grpc_public/server.py);
    the open-mode tenant outside one. HTTP routes use `tenancy.tenant_of(request)`."""
    return CALL_TENANT.get() or open_tenant()


def presented_key(authorization: str | None, api_key: str | None) -> str:
    """The one key a request presents; AuthenticationError when there is none, or two that differ."""
    bearer: str | None = None
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not value.strip():
            raise AuthenticationError(is_missing=False)
        bearer = value.strip()
    api_key = api_key.strip() if api_key is not None else None
    if bearer is None and not api_key:
        raise AuthenticationError(is_missing=True)
    if bearer is not None and api_key and not hmac.compare_digest(bearer.encode(), api_key.encode()):
        raise AuthenticationError(is_missing=False)
    return bearer if bearer is not None else str(api_key)


class AuthMiddleware:
    """Authenticates every HTTP request except OPEN_PATHS, before the body is read. On success the
    tenant goes on the request's stats (read by `tenancy.tenant_of` and the audit line);
    otherwise a 401 in the route's protocol shape. Sits inside RequestContextMiddleware, so refusals
    carry a request ID and get their audit line too."""

    def __init__(self, app: ASGIApp, authenticator: Authenticator, metrics: CodecMetrics) -> None:
        self.app = app
        self.authenticator = authenticator
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        try:
            # A drainer's in-process run of a queued job (never a request from the network) carries the
            # tenant of the key that queued it.
            tenant = JOB_TENANT.get() or self.authenticator.authenticate(
                header(scope, AUTHORIZATION), header(scope, X_API_KEY)
            )
        except AuthenticationError as exc:
            self.metrics.observe_auth_failure(exc.reason)
            await error_response(describe(exc))(scope, receive, send)
            return
        stats = state.get("stats")
        if not isinstance(stats, RequestStats):  # RequestContextMiddleware runs first and made it
            stats = state["stats"] = RequestStats(request_id=str(state.get("request_id", "")))
        stats.identify(tenant)
        await self.app(scope, receive, send)
