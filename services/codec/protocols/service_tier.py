"""A request's priority class, from OpenAI's `service_tier` or the `x-kvrelay-priority` header.

OpenAI Chat Completions and Responses: `service_tier` `flex` is the low class, `auto` and `default` the
normal one, `priority` (and the older `scale`) the high one; the response's `service_tier` says the tier
that served it (`flex`, `default` or `priority`). Every protocol (Completions, Anthropic's Messages, the
public gRPC API as metadata) also reads the header `x-kvrelay-priority: high | normal | low`, echoed on
the response. Both given: they must name the same class. The high class is a permission of the API key
(`kvrelay keys add --priority-tier`): a key without it gets a 400 that says so; in open mode everyone
may. The low class and the normal one are everyone's. docs/priority.md.
"""

from __future__ import annotations

from services.codec.metrics import RequestStats
from services.common import priority
from services.common.errors import InvalidRequestError
from services.common.tenants import Tenant

HEADER = priority.HEADER
PARAM = "service_tier"
TIER_CLASS = {"auto": "normal", "default": "normal", "flex": "low", "priority": "high", "scale": "high"}
CLASS_TIER = {"high": "priority", "normal": "default", "low": "flex"}


def resolve_class(service_tier: str | None, header: str | None, tenant: Tenant) -> str:
    """The class (high, normal or low) a request asks for; InvalidRequestError when the header names
    none, disagrees with `service_tier`, or asks for the high class without the key's permission."""
    from_tier = TIER_CLASS.get(service_tier) if service_tier is not None else None
    from_header = None
    if header is not None:
        from_header = header.strip().lower()
        if from_header not in priority.BY_NAME:
            raise InvalidRequestError(
                f"header {HEADER} must be one of high, normal, low; got {header[:32]!r}", HEADER
            )
    if from_tier is not None and from_header is not None and from_tier != from_header:
        raise InvalidRequestError(
            f"{PARAM} {service_tier!r} asks for the {from_tier} class but header {HEADER} for {from_header}",
            PARAM,
        )
    chosen = from_tier or from_header or "normal"
    if chosen == "high" and not tenant.may_use_priority:
        raise InvalidRequestError(
            "the high priority class is not allowed for this API key: ask the operator for a key made "
            f'with `kvrelay keys add --priority-tier`, or use {PARAM} "default" or "flex"',
            PARAM if from_tier is not None else HEADER,
        )
    return chosen


def served_tier(stats: RequestStats) -> str:
    """OpenAI's `service_tier` for the response: the tier of the class the request ran in."""
    return CLASS_TIER[stats.priority_class or "normal"]
