"""The keys that seal `compaction` items of /v1/responses/compact, and the sealing itself.

A compaction item carries the folded conversation back to the client as `encrypted_content`; the client
returns it later instead of the history. The client must neither read it (it may hold the model's
summary of a system prompt it never saw) nor forge it (it would then choose what the model believes was
said), and one tenant must not replay another's item, nor replay it against another model whose
summary format differs. So each blob is AES-256-GCM: a random 96-bit nonce per seal, and as associated
data the format version, the key id, the tenant and the model. A blob made for one tenant or model fails
authentication for any other.

The blob is URL-safe text:

    kvc1.<key_id>.<base64url, unpadded, of nonce (12 bytes) | ciphertext | tag (16 bytes)>

The plaintext is the payload as compact UTF-8 JSON. The key id travels in clear so that a ring of
several keys knows which one to try (and says "unknown key" rather than "forged" once a key is retired).

Keys come from a file (responses.compaction_keys_file; the chart mounts it from a Secret) of lines
`<key_id>:<base64 of 32 bytes>`, blank lines and `#` comments allowed. The first key seals; every key
opens, so a rotation is: put the new key first and keep the old one second, roll the codecs, and remove
the old key once items sealed with it no longer matter (docs/deploy.md, "Compaction keys"). Key ids are
`[A-Za-z0-9_-]{1,32}`. Make a key with

    python -c "import os,base64;print('k1:'+base64.b64encode(os.urandom(32)).decode())"

or `echo "k1:$(openssl rand -base64 32)"`. The file is read once, at start: the chart rolls the codec
pods when the Secret changes.

Without a file each process draws one random key: its items open only on the codec process that made
them, which is fine for one `make serve` and wrong behind several replicas (a warning says so, once).
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import re
import secrets
from typing import Any, Literal

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from services.common.errors import ConfigError, InvalidRequestError

logger = logging.getLogger(__name__)

FORMAT_VERSION = "kvc1"
KEY_BYTES = 32  # AES-256
NONCE_BYTES = 12  # 96 bits: GCM's native nonce size, drawn at random per seal
TAG_BYTES = 16
# Far above any summary compaction_max_output_tokens allows, below the WebSocket frame limit (16 MiB), so
# a hostile item is refused before any base64 or AES work on megabytes of it.
MAX_BLOB_CHARS = 8 * 1024 * 1024

_KEY_ID = re.compile(r"[A-Za-z0-9_-]{1,32}")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")
_ephemeral_warned = False

RejectReason = Literal["malformed", "unknown_key", "authentication"]
_REASONS: dict[str, str] = {
    "malformed": "is malformed",
    "unknown_key": "was sealed with a key this server does not hold",
    "authentication": "failed authentication",
}


class CompactionRejectedError(InvalidRequestError):
    """A compaction item's encrypted_content that does not open: a 400 naming the caller's `param`.

    The message says only which of three things went wrong (malformed, unknown key id, failed
    authentication): never which associated-data field differed, so a caller learns nothing about
    other tenants or models by probing. `reason` carries the same for metrics and logs.
    """

    def __init__(self, reason: RejectReason, param: str | None = None) -> None:
        super().__init__(
            f"the compaction item's encrypted_content {_REASONS[reason]}: it cannot be opened by this "
            "server for this tenant and model",
            param=param,
        )
        self.reason: RejectReason = reason


def _aad(key_id: str, tenant: str, model: str) -> bytes:
    """The associated data: a JSON array, so no choice of tenant or model can collide with another."""
    return json.dumps([FORMAT_VERSION, key_id, tenant, model], ensure_ascii=True).encode("ascii")


class CompactionKeys:
    """A ring of AES-256-GCM keys: the first seals, every one opens."""

    def __init__(self, keys: list[tuple[str, bytes]]) -> None:
        """`keys` in file order, (key id, 32 bytes); ids unique. from_file() is the usual way in."""
        if not keys:
            raise ValueError("a compaction key ring needs at least one key")
        self._ciphers: dict[str, AESGCM] = {}
        for key_id, key in keys:
            if not _KEY_ID.fullmatch(key_id):
                raise ValueError(f"compaction key id {key_id!r} is not [A-Za-z0-9_-]{{1,32}}")
            if len(key) != KEY_BYTES:
                raise ValueError(f"compaction key {key_id!r} is not {KEY_BYTES} bytes")
            if key_id in self._ciphers:
                raise ValueError(f"compaction key id {key_id!r} appears twice")
            self._ciphers[key_id] = AESGCM(key)
        self._sealing_id = keys[0][0]

    @property
    def sealing_key_id(self) -> str:
        return self._sealing_id

    @property
    def key_ids(self) -> tuple[str, ...]:
        """Every key id that opens, the sealing one first (for logs; the ids are not secret)."""
        return tuple(self._ciphers)

    @classmethod
    def ephemeral(cls) -> CompactionKeys:
        """One random key under a random id, so another process's item reads as "unknown key"."""
        global _ephemeral_warned
        if not _ephemeral_warned:
            _ephemeral_warned = True
            logger.warning(
                "responses.compaction_keys_file is not set: compacted items are sealed with a random key "
                "of this process and open only on this codec process (fine for one process; set it, or "
                "the chart's responses.compactionKeys.existingSecret, behind several replicas)"
            )
        return cls([(f"ephemeral-{secrets.token_hex(8)}", os.urandom(KEY_BYTES))])

    @classmethod
    def from_file(cls, path: str | None) -> CompactionKeys:
        """The ring in `path` (see the module docstring); None: ephemeral().

        A bad file is a ConfigError naming the file and line, never the line's text: it may be key material.
        """
        if path is None:
            return cls.ephemeral()
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
            raise ConfigError(f"responses.compaction_keys_file {path!r} cannot be read: {reason}") from None
        keys: list[tuple[str, bytes]] = []
        seen: set[str] = set()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            where = f"responses.compaction_keys_file {path!r} line {number}"
            key_id, sep, encoded = line.partition(":")
            key_id, encoded = key_id.strip(), encoded.strip()
            if not sep:
                raise ConfigError(f"{where}: expected <key_id>:<base64 of {KEY_BYTES} bytes>")
            if not _KEY_ID.fullmatch(key_id):
                raise ConfigError(f"{where}: the key id is not 1 to 32 of [A-Za-z0-9_-]")
            if key_id in seen:
                raise ConfigError(f"{where}: key id {key_id!r} appears twice")
            try:
                key = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                raise ConfigError(f"{where}: key {key_id!r} is not valid base64") from None
            if len(key) != KEY_BYTES:
                raise ConfigError(
                    f"{where}: key {key_id!r} decodes to {len(key)} bytes, not {KEY_BYTES} (AES-256)"
                )
            seen.add(key_id)
            keys.append((key_id, key))
        if not keys:
            raise ConfigError(f"responses.compaction_keys_file {path!r} holds no key")
        return cls(keys)

    def seal(self, payload: dict[str, Any], *, tenant: str, model: str) -> str:
        """`payload` (JSON-serializable) as a blob only this ring opens, and only for `tenant` and `model`."""
        plaintext = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        nonce = os.urandom(NONCE_BYTES)
        key_id = self._sealing_id
        sealed = self._ciphers[key_id].encrypt(nonce, plaintext.encode("utf-8"), _aad(key_id, tenant, model))
        body = base64.urlsafe_b64encode(nonce + sealed).rstrip(b"=").decode("ascii")
        blob = f"{FORMAT_VERSION}.{key_id}.{body}"
        if len(blob) > MAX_BLOB_CHARS:
            # open() would refuse it: fail here, on the server's side, rather than hand out a dead item.
            raise ValueError(f"compaction payload too large to seal ({len(blob)} > {MAX_BLOB_CHARS} chars)")
        return blob

    def open(
        self, blob: str, *, tenant: str, model: str, param: str | None = "encrypted_content"
    ) -> dict[str, Any]:
        """The payload sealed in `blob` for `tenant` and `model`; CompactionRejectedError (400, `param`)
        for anything else, whatever the input (any type, any length, any bytes)."""
        if not isinstance(blob, str) or not blob or len(blob) > MAX_BLOB_CHARS:
            raise CompactionRejectedError("malformed", param)
        parts = blob.split(".")
        if len(parts) != 3 or parts[0] != FORMAT_VERSION:
            raise CompactionRejectedError("malformed", param)
        _, key_id, body = parts
        if not _KEY_ID.fullmatch(key_id) or not _BASE64URL.fullmatch(body):
            raise CompactionRejectedError("malformed", param)
        try:
            raw = base64.b64decode(body + "=" * (-len(body) % 4), altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            raise CompactionRejectedError("malformed", param) from None
        if len(raw) < NONCE_BYTES + TAG_BYTES:
            raise CompactionRejectedError("malformed", param)
        cipher = self._ciphers.get(key_id)
        if cipher is None:
            raise CompactionRejectedError("unknown_key", param)
        try:
            plaintext = cipher.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], _aad(key_id, tenant, model))
        except InvalidTag:
            raise CompactionRejectedError("authentication", param) from None
        try:
            payload = json.loads(plaintext.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):  # authentic but not ours: a key shared with something else
            raise CompactionRejectedError("malformed", param) from None
        if not isinstance(payload, dict):
            raise CompactionRejectedError("malformed", param)
        return payload
