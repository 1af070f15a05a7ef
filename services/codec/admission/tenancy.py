"""Who a request is for: the authenticated tenant, and the prefix-cache salt that follows from it.

`services/codec/admission/auth.py` authenticates the API key and stores the `Tenant` on the request's
`RequestStats` (metrics.py), the one place a request's tenant is held; everything downstream (quotas,
the fair queue, the cache salt, the audit log) reads it through `tenant_of`. On the public gRPC API the
auth interceptor hands it over in `CALL_TENANT`, which the servicer moves onto the call's stats at once.
In open mode (no keys file) every request is the tenant "default".

The `Tenant` and its cache salt are defined in services/common/tenants.py.
"""

from __future__ import annotations

from contextvars import ContextVar

from starlette.requests import HTTPConnection

from services.common.tenants import Tenant, open_tenant

# The public gRPC API's hand-off from its auth interceptor to the servicer of the same call (each call
# runs in its own task and context).
CALL_TENANT: ContextVar[Tenant | None] = ContextVar("kvrelay_call_tenant", default=None)
# A drainer's hand-off to the codec app it calls in-process (services/codec/lane/drainer.py): the tenant of
# the queued job it runs. Set only inside that call's task; a request from the network never has it.
JOB_TENANT: ContextVar[Tenant | None] = ContextVar("kvrelay_job_tenant", default=None)


def tenant_of(connection: HTTPConnection) -> Tenant:
    """The tenant auth stored on this request's stats; the open-mode tenant when auth did not run."""
    tenant = getattr(getattr(connection.state, "stats", None), "tenant", None)
    return tenant if isinstance(tenant, Tenant) else open_tenant()
