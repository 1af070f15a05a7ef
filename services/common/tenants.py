"""A tenant, as the codec's auth hands it on (services/codec/admission/tenancy.py), and the prefix-cache
salt that follows from it. Torch-free and free of any web framework, so the codec's lowest modules (its
metrics, which hold the tenant on each request's stats) can name it.

The cache salt is derived from the tenant, never taken from the request, so one tenant can never hit
(or time) another's cached prefixes. Tenants in one `auth.shared_cache_groups` entry share a salt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_TENANT = "default"
SALT_DOMAIN = b"kvrelay-tenant-salt/v1\x00"


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    key_id: str | None  # the API key's public ID; None in open mode
    cache_salt: bytes
    is_admin: bool = False  # may read /status; in open mode (loopback, or auth.allow_open) everyone may
    # may ask for prompt_cache_retention "24h" (a key's cache_retention_24h); in open mode everyone may
    may_retain_24h: bool = False
    # may ask for the high priority class (service_tier "priority"; a key's priority_tier); in open mode
    # everyone may
    may_use_priority: bool = False


def cache_salt(tenant_id: str, shared_groups: Sequence[Sequence[str]] = ()) -> bytes:
    """16 bytes that name the tenant's prefix-cache namespace (its group's, when it shares one)."""
    group = next((sorted(g) for g in shared_groups if tenant_id in g), [tenant_id])
    return hashlib.sha256(SALT_DOMAIN + "\x00".join(group).encode()).digest()[:16]


def open_tenant(shared_groups: Sequence[Sequence[str]] = ()) -> Tenant:
    return Tenant(
        DEFAULT_TENANT,
        None,
        cache_salt(DEFAULT_TENANT, shared_groups),
        may_retain_24h=True,
        may_use_priority=True,
    )
