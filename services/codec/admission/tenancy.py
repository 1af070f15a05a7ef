"""Who a request is for: the authenticated tenant, and the prefix-cache salt that follows from it.

`services/codec/admission/auth.py` authenticates the API key and stores the `Tenant` on the request's
`RequestStats` (metrics.py), the one place a request's tenant is held; everything downstream (quotas,
the fair queue, the cache salt, the audit log) reads it through `tenant_of`. On the public gRPC API the
auth interceptor hands it over in `CALL_TENANT`, which the servicer moves onto the call's stats at once.
In open mode (no keys file) every request is the tenant "default".

The cache salt is derived from the tenant, never taken from the request, so one tenant can never hit
(or time) another's cached prefixes. Tenants in one `auth.shared_cache_groups` entry share a salt.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.requests import HTTPConnection

DEFAULT_TENANT = "default"
SALT_DOMAIN = b"kvrelay-tenant-salt/v1\x00"


@dataclass(frozen=True)
class Tenant:
    tenant_id: str
    key_id: str | None  # the API key's public ID; None in open mode
    cache_salt: bytes
    is_admin: bool = False  # may read /status; in open mode (loopback, or auth.allow_open) everyone may


def cache_salt(tenant_id: str, shared_groups: Sequence[Sequence[str]] = ()) -> bytes:
    """16 bytes that name the tenant's prefix-cache namespace (its group's, when it shares one)."""
    group = next((sorted(g) for g in shared_groups if tenant_id in g), [tenant_id])
    return hashlib.sha256(SALT_DOMAIN + "\x00".join(group).encode()).digest()[:16]


def open_tenant(shared_groups: Sequence[Sequence[str]] = ()) -> Tenant:
    return Tenant(DEFAULT_TENANT, None, cache_salt(DEFAULT_TENANT, shared_groups))


# The public gRPC API's hand-off from its auth interceptor to the servicer of the same call (each call
# runs in its own task and context).
CALL_TENANT: ContextVar[Tenant | None] = ContextVar("kvrelay_call_tenant", default=None)


def tenant_of(connection: HTTPConnection) -> Tenant:
    """The tenant auth stored on this request's stats; the open-mode tenant when auth did not run."""
    tenant = getattr(getattr(connection.state, "stats", None), "tenant", None)
    return tenant if isinstance(tenant, Tenant) else open_tenant()
