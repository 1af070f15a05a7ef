"""Session keys: which conversation a request belongs to, for the router's session affinity.

The router maps `GenerateRequest.session_key` to a replica by consistent hashing, so the turns of one
conversation land where its prefix is cached. The key is for routing only, never a cache key. Rules,
first match wins (docs/protocols.md, "Session key"):

1. the client's `x-session-id` (an HTTP header on any route, or public gRPC metadata), any length;
2. the client's own session field: OpenAI `prompt_cache_key` (Chat Completions, Responses) or
   Anthropic `metadata.user_id`;
3. for chat-like requests, the first user turn's text with the served model name: the first message
   with role `user`. System and developer messages, Responses `instructions` and any turn before the
   first user one (a canned assistant greeting) are shared across sessions, so they never count;
4. otherwise none (""): a raw Completions prompt, or a conversation with no user text. The router's
   prefix index handles those.

A key is opaque and fixed-size: the first 32 hex digits of SHA-256 over "kvrelay-session/v1", the
source and its value(s), each length-prefixed, then scoped to the authenticated tenant the same way (so
a client can never land in another tenant's session by choosing its key). No user text reaches the router
or a log through it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

SESSION_HEADER = "x-session-id"  # the HTTP header and the public gRPC metadata key
KEY_DOMAIN = b"kvrelay-session/v1"
KEY_HEX_DIGITS = 32
NO_SESSION = ""


class SessionSource(StrEnum):
    """Where a key came from; part of the hash, so equal values from different sources differ."""

    HEADER = "x-session-id"
    PROMPT_CACHE_KEY = "prompt_cache_key"
    ANTHROPIC_USER_ID = "metadata.user_id"
    FIRST_USER_TURN = "first_user_turn"
    TENANT = "tenant"  # a key scoped to its tenant: another tenant's equal value is another session


def opaque_key(source: SessionSource, *values: str) -> str:
    """32 hex digits of SHA-256 over the domain, the source and the values, each length-prefixed (so
    no two different inputs frame to the same bytes)."""
    parts = [KEY_DOMAIN, source.value.encode(), *(value.encode("utf-8", "surrogatepass") for value in values)]
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return digest.hexdigest()[:KEY_HEX_DIGITS]


def first_user_text(messages: Sequence[Mapping[str, Any]]) -> str | None:
    """The content of the first `user` message of chat-template messages, or None when there is none.
    Content is already text here (the protocol schemas join text parts before templating)."""
    for message in messages:
        if message.get("role") == "user":
            content = message.get("content")
            return content if isinstance(content, str) else None
    return None


def session_key(
    *,
    header: str | None = None,
    client_key: tuple[SessionSource, str | None] | None = None,
    model: str = "",
    messages: Sequence[Mapping[str, Any]] = (),
    tenant: str = "",
) -> str:
    """The request's session key by the rules above: `header` (x-session-id), then `client_key`
    (source and value, e.g. prompt_cache_key), then the first user turn of `messages` with `model`;
    "" when none applies. Empty values count as absent. With `tenant` (the authenticated one), the key
    is scoped to it: two tenants sending the same prompt_cache_key are two sessions."""
    key = _unscoped_key(header, client_key, model, messages)
    return opaque_key(SessionSource.TENANT, tenant, key) if key and tenant else key


def _unscoped_key(
    header: str | None,
    client_key: tuple[SessionSource, str | None] | None,
    model: str,
    messages: Sequence[Mapping[str, Any]],
) -> str:
    if header:
        return opaque_key(SessionSource.HEADER, header)
    if client_key is not None:
        source, value = client_key
        if value:
            return opaque_key(source, value)
    text = first_user_text(messages)
    if not text or not text.strip():
        return NO_SESSION
    return opaque_key(SessionSource.FIRST_USER_TURN, model, text)
