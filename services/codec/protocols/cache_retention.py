"""The clients' cache knobs as cache breakpoints for the workers (docs/kv-tiers.md), and what they report.

OpenAI's `prompt_cache_retention` against the tenant's permission.

`in_memory` (and no value) is every tenant's: the prefix cache and the tiers as configured. `24h` asks for
a prefix kept a day in the disk and shared tiers, which costs the operator storage, so it is a permission
of the API key (`kvrelay keys add --cache-retention-24h`, the keys file's `cache_retention_24h`); a key
without it gets a 400 that says so. In open mode (no keys) everyone may. The schemas refuse any other
value. A `24h` request's whole prompt is one cache breakpoint kept RETENTION_24H_S: the workers write it
through to the disk and shared tiers whatever `kv_tiers.write_through` says (docs/kv-tiers.md).

Anthropic's `cache_control`: each breakpoint is the prompt up to the end of the block that carries it,
kept 5 minutes or an hour at least. Where that ends in tokens is found by rendering the request once more
per breakpoint with a marker right after the block (`PromptFields.marked`): the two prompts share the
tokens up to the breakpoint (protocols/output.py shared_prefix_lengths). The workers count, per
breakpoint, the tokens up to it that the request computed (whole blocks), which is
`cache_creation_input_tokens`, split by ttl. A marker the template does not show (a tool under
`tool_choice: none`, a template without tools) marks nothing: that breakpoint ends where the one before it
does.
"""

from __future__ import annotations

from typing import Any

from services.codec.protocols.output import shared_prefix_lengths
from services.codec.protocols.schemas.anthropic import PromptFields
from services.codec.state import CodecState
from services.common.engine_input import CacheBreakpoint
from services.common.errors import InvalidRequestError
from services.common.tenants import Tenant

PARAM = "prompt_cache_retention"
RETENTION_24H_S = 24 * 3600
ANTHROPIC_TTL_S = {"5m": 300, "1h": 3600}


def check_retention(retention: str | None, tenant: Tenant) -> None:
    """A 400 when `retention` is `24h` and the tenant's key may not ask for it."""
    if retention == "24h" and not tenant.may_retain_24h:
        raise InvalidRequestError(
            f'{PARAM} "24h" is not allowed for this API key: ask the operator for a key made with '
            '`kvrelay keys add --cache-retention-24h`, or use "in_memory"',
            PARAM,
        )


def retention_breakpoints(retention: str | None, num_prompt_tokens: int) -> tuple[CacheBreakpoint, ...]:
    """What `retention` asks of the workers: the whole prompt kept a day for `24h`, nothing more else."""
    if retention != "24h":
        return ()
    return (CacheBreakpoint(num_prompt_tokens, RETENTION_24H_S),)


async def anthropic_breakpoints(
    state: CodecState, body: PromptFields, prompt_ids: list[int]
) -> tuple[CacheBreakpoint, ...]:
    """Each `cache_control` of `body` (whose prompt is `prompt_ids`) as a breakpoint, in prompt order. One
    whose marked copy does not make a prompt (the template refuses it) ends where the one before it does."""
    points = body.cache_breakpoints()
    if not points:
        return ()
    messages, tools = body.template_messages(), body.toolset()
    variants: list[Any] = []
    for point in points:
        marked = body.marked(point)
        try:
            variants.append(None if marked is None else (marked.template_messages(), marked.toolset()))
        except InvalidRequestError:
            variants.append((messages, tools))  # the same prompt: it marks nothing
    lengths = await shared_prefix_lengths(
        state, prompt_ids, messages, variants, tools=tools, thinking=body.thinking_wish()
    )
    breakpoints, end = [], 0
    for point, length in zip(points, lengths, strict=True):
        end = max(end, length)
        breakpoints.append(CacheBreakpoint(end, ANTHROPIC_TTL_S[point.ttl]))
    return tuple(breakpoints)


def creation_by_ttl(breakpoints: tuple[CacheBreakpoint, ...], written: tuple[int, ...]) -> dict[str, int]:
    """Anthropic's `cache_creation`: the tokens the workers wrote for the 5m and the 1h breakpoints."""
    creation = {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}
    for point, num_tokens in zip(breakpoints, written, strict=False):
        ttl = "1h" if point.ttl_s >= ANTHROPIC_TTL_S["1h"] else "5m"
        creation[f"ephemeral_{ttl}_input_tokens"] += num_tokens
    return creation
