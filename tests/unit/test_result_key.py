"""The exact-result cache's key (services/codec/protocols/result_key.py): every field of the request the
workers get and of how the codec reads the output changes the key, except the documented exclusions, which
leave it unchanged. The walk covers every dataclass field reachable from a request with every optional
field set, so a field added to any of these types later fails here until it is keyed or excluded."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Mapping
from typing import Any

from services.codec.backend.protocol import GenerationRequest
from services.codec.protocols.output import OutputPlan
from services.codec.protocols.result_key import EXCLUDED, result_key
from services.codec.text.tool_calls import CallFormat, Tool, ToolChoice, ToolChoiceMode, ToolSet
from services.common.engine_input import CacheBreakpoint
from services.common.grammar import Constraint, GrammarKind, GrammarSpec
from services.common.sampling import SamplingParams

NUMERICS = "model-fp/safetensors/c-kernels-avx512/deterministic"
GRAMMAR = GrammarSpec(GrammarKind.REGEX, "[a-z]+", strict=True)
REQUEST = GenerationRequest(
    request_id="req_1",
    prompt_token_ids=[5, 6, 7],
    sampling=SamplingParams(
        n=2, temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, repetition_penalty=1.1,
        frequency_penalty=0.2, presence_penalty=0.3, seed=11, max_tokens=64, min_tokens=2,
        stop_token_ids=(9,), ignore_eos=True, logprobs=2, grammar=GRAMMAR,
    ),
    stop=("END",),
    timeout_s=30.0,
    session_key="s" * 32,
    cache_salt=b"tenant-a",
    priority=1,
    cache_breakpoints=(CacheBreakpoint(2, 300),),
    encoder_token_ids=(8, 9, 1),  # an encoder-decoder model's source: the same decoder start, other results
)  # fmt: skip
PLAN = OutputPlan(
    tools=ToolSet(
        (Tool("tides", {"type": "object"}, "Tide tables", strict=True), Tool("moon", {"type": "object"})),
        ToolChoice(ToolChoiceMode.NAMED, "moon", parallel=False, allowed=("moon",)),
    ),
    call_format=CallFormat("hermes", "<tool_call>", "</tool_call>", start_id=1, end_id=2),
    thinks=True,
    opened=True,
    constraint=Constraint(GRAMMAR, "response_format"),
)


# Where another value must also be valid where it sits: the named tool must be one of the tools.
OTHER: dict[tuple[type, str], Any] = {(ToolChoice, "name"): "tides"}


def changed(value: Any) -> Any:
    """Another value of the same kind."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, enum.Enum):
        return next(member for member in type(value) if member != value)
    if isinstance(value, int | float):
        return value + 1
    if isinstance(value, str):
        return value + "x"
    if isinstance(value, bytes):
        return value + b"x"
    if isinstance(value, list | tuple):  # one more element, unlike the first (tools need distinct names)
        first = value[0]
        if dataclasses.is_dataclass(first) and not isinstance(first, type):
            name = dataclasses.fields(first)[0].name
            first = dataclasses.replace(first, **{name: changed(getattr(first, name))})
        return type(value)([*value, first])
    if isinstance(value, Mapping):
        return {**value, "extra": 1}
    raise AssertionError(f"no other value for {type(value).__name__}: give the walk one")


def variants(obj: Any, path: str = "") -> Iterator[tuple[str, type, str, Any]]:
    """(path, owner type, field, a copy of `obj` with that one field changed), for every field reachable."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = f"{path}{f.name}"
        assert value is not None, f"{where} is None in the walk's request: set it, so the walk covers it"
        if not dataclasses.is_dataclass(value):  # a dataclass: its own fields are walked instead
            other = OTHER.get((type(obj), f.name)) or changed(value)
            yield where, type(obj), f.name, dataclasses.replace(obj, **{f.name: other})
        if (type(obj), f.name) in EXCLUDED:
            continue  # left out whole: nothing inside it counts
        if dataclasses.is_dataclass(value):
            for inner, owner, name, copy in variants(value, f"{where}."):
                yield inner, owner, name, dataclasses.replace(obj, **{f.name: copy})
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            for inner, owner, name, copy in variants(value[0], f"{where}[0]."):
                yield inner, owner, name, dataclasses.replace(obj, **{f.name: (copy, *value[1:])})


def test_every_field_changes_the_key_but_the_documented_exclusions() -> None:
    base = result_key(REQUEST, PLAN, NUMERICS)
    walked: set[tuple[type, str]] = set()
    unkeyed = []
    for where, owner, name, copy in [
        *((f"request.{w}", o, n, (c, PLAN)) for w, o, n, c in variants(REQUEST)),
        *((f"plan.{w}", o, n, (REQUEST, c)) for w, o, n, c in variants(PLAN)),
    ]:
        walked.add((owner, name))
        same = result_key(*copy, NUMERICS) == base
        if same != ((owner, name) in EXCLUDED):
            unkeyed.append(
                f"{where} ({'left out' if same else 'keyed'} but {'not ' if same else ''}excluded)"
            )
    assert not unkeyed, unkeyed
    assert set(EXCLUDED) <= walked  # every exclusion names a field that exists
    assert result_key(REQUEST, PLAN, NUMERICS + "-other") != base  # other numerics, another key


def test_the_key_is_stable_and_tenant_scoped() -> None:
    assert result_key(REQUEST, PLAN, NUMERICS) == result_key(dataclasses.replace(REQUEST), PLAN, NUMERICS)
    other_tenant = dataclasses.replace(REQUEST, cache_salt=b"tenant-b")
    assert result_key(other_tenant, PLAN, NUMERICS) != result_key(REQUEST, PLAN, NUMERICS)
    assert len(result_key(REQUEST, OutputPlan(), NUMERICS)) == 64
