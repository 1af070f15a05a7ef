"""The exact-result cache's key (issue 50): what makes two requests' outputs the same, hashed.

A stored result is replayed only for a request that would generate the same tokens and read them the same
way, so the key covers everything that decides either, and nothing else:
- the request the workers get (`GenerationRequest`): the prompt's token IDs, every sampling field (the
  grammar included), the tenant's `cache_salt` (a tenant never reads another's results), and the stop
  strings the codec cuts the text at;
- how the codec reads the output (`OutputPlan`): the tools and their call format, the reasoning parser's
  settings, the constraint;
- the numerics fingerprint of the workers (the served model fingerprint and the mode; under
  engine.deterministic it names the kernel build and threads too), so a result computed by other numerics
  is never replayed in that mode.

Fields that cannot change the output are left out by name, each with its reason (`EXCLUDED`); a test walks
every field of these types and fails on one that neither changes the key nor is listed, so a field added
later cannot be forgotten. The key is the SHA-256 of a canonical JSON form, versioned (`KEY_VERSION`).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from services.codec.backend import results
from services.codec.backend.protocol import GenerationRequest
from services.codec.metrics import RequestStats
from services.codec.protocols.output import OutputPlan
from services.codec.state import CodecState
from services.codec.text.tool_calls import ToolSet
from services.common.grammar import Constraint

KEY_VERSION = 1

# (type, field) -> why it cannot change what is generated or how it is read.
EXCLUDED: dict[tuple[type, str], str] = {
    (GenerationRequest, "request_id"): "names one stream, not what it holds",
    (GenerationRequest, "timeout_s"): "a deadline ends a request early, and such a result is never stored",
    (GenerationRequest, "session_key"): "routing affinity only",
    (GenerationRequest, "priority"): "when a request runs, not what it generates",
    (GenerationRequest, "cache_breakpoints"): "how long KV is kept below the pool, not what is generated",
    (Constraint, "param"): "the request field a 400 names",
    (ToolSet, "param"): "the request field a 400 names",
    (ToolSet, "choice_param"): "the request field a 400 names",
}


def result_key(request: GenerationRequest, plan: OutputPlan, numerics: str) -> str:
    """64 hex digits naming the result of `request`, read by `plan`, on workers of `numerics`."""
    canonical = {
        "version": KEY_VERSION,
        "numerics": numerics,
        "request": _canonical(request),
        "plan": _canonical(plan),
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _canonical(value: Any) -> Any:
    """Plain JSON data for `value`: dataclasses by field name (EXCLUDED ones left out), tagged with their
    type's name; enums by value; bytes as hex; sequences as lists; mappings with string keys."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {
            f.name: _canonical(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if (type(value), f.name) not in EXCLUDED
        }
        return {"type": type(value).__name__, "fields": fields}
    if isinstance(value, enum.Enum):
        return _canonical(value.value)
    if isinstance(value, bytes | bytearray):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    if isinstance(value, set | frozenset):
        return sorted((_canonical(item) for item in value), key=lambda item: json.dumps(item, sort_keys=True))
    if isinstance(value, Mapping):
        return {str(key): _canonical(item) for key, item in value.items()}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"no canonical form for {type(value).__name__} in a result key")


async def result_key_if_asked(
    asked: str,
    state: CodecState,
    stats: RequestStats,
    tenant_id: str,
    generation: GenerationRequest,
    plan: OutputPlan,
) -> str | None:
    """The request's key in the exact-result cache when it asks for it (`asked`: its
    x-kvrelay-result-cache header or gRPC metadata is "use") and may use it: the cache is on, its tenant
    opted in, and it is greedy or seeded. Asked but not eligible: `stats.result_cache` says "skip"."""
    if asked.strip().lower() != "use":
        return None
    cache = state.generator.results
    stats.result_cache = "skip"
    if cache is None or not cache.admits(tenant_id) or not results.is_replayable(generation.sampling):
        return None
    info = await state.info.get()
    return result_key(generation, plan, info.numerics_fingerprint)
