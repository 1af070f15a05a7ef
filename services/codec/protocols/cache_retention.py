"""OpenAI's `prompt_cache_retention` against the tenant's permission.

`in_memory` (and no value) is every tenant's: the prefix cache and the tiers as configured. `24h` asks for
a prefix kept a day in the disk and shared tiers, which costs the operator storage, so it is a permission
of the API key (`kvrelay keys add --cache-retention-24h`, the keys file's `cache_retention_24h`); a key
without it gets a 400 that says so. In open mode (no keys) everyone may. The schemas refuse any other
value.
"""

from __future__ import annotations

from services.common.errors import InvalidRequestError
from services.common.tenants import Tenant

PARAM = "prompt_cache_retention"


def check_retention(retention: str | None, tenant: Tenant) -> None:
    """A 400 when `retention` is `24h` and the tenant's key may not ask for it."""
    if retention == "24h" and not tenant.may_retain_24h:
        raise InvalidRequestError(
            f'{PARAM} "24h" is not allowed for this API key: ask the operator for a key made with '
            '`kvrelay keys add --cache-retention-24h`, or use "in_memory"',
            PARAM,
        )
