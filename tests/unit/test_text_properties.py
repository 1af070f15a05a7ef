"""Properties of the codec's streaming text machinery, over inputs hypothesis generates (derandomized: the
same examples on every run, so a failure reproduces; a failing example becomes a regression test here):

- the stop-string matcher emits, whatever the split of the text into pushes, exactly the text before the
  first-ending match (longest on a tie), or all of it;
- the incremental detokenizer's deltas, whatever the split of the token IDs into pushes, join into the
  tokenizer's own decode of the whole sequence (the real SmolLM2 tokenizer, byte-level BPE);
- the tool-call parser and the reasoning parser give the same calls, arguments, reasoning and answer
  whatever the split of the text;
- a request body of any JSON shape, or any bytes, sent to each generation route is answered 200 or a
  4xx in the protocol's shape, never a 5xx.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.codec.text.detokenizer import IncrementalDetokenizer
from services.codec.text.reasoning import END, START, AnswerPiece, ReasoningParser, ReasoningPiece
from services.codec.text.stop_strings import StopStringMatcher
from services.codec.text.tokenizer import Tokenizer
from services.codec.text.tool_calls import (
    HERMES,
    CallArguments,
    CallEnded,
    CallParser,
    CallStarted,
    ParseEvent,
    TextPiece,
    Tool,
    ToolSet,
)
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, make_config, scripted

SETTINGS = settings(max_examples=200, derandomize=True, deadline=None, database=None)


def with_fixture(max_examples: int) -> settings:
    """SETTINGS for a test that takes a pytest fixture (the same one for every example, as meant)."""
    return settings(
        SETTINGS, max_examples=max_examples, suppress_health_check=[HealthCheck.function_scoped_fixture]
    )


ALPHABET = "ab<>/_ \n{}\"'é😀"


def split(text: Sequence[Any], cuts: list[int]) -> list[Any]:
    """`text` cut at the positions `cuts` (taken modulo its length), in order."""
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


# -- stop strings ----------------------------------------------------------------------------------------


def first_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    best = None
    for stop in stops:
        at = text.find(stop)
        if at >= 0 and (
            best is None or (at + len(stop), -len(stop)) < (best[0] + len(best[1]), -len(best[1]))
        ):
            best = (at, stop)
    return (text, None) if best is None else (text[: best[0]], best[1])


@SETTINGS
@given(
    text=st.text(alphabet=ALPHABET, max_size=60),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=5), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
)
def test_stop_strings_are_found_whatever_the_split(text: str, stops: list[str], cuts: list[int]) -> None:
    matcher = StopStringMatcher(stops)
    emitted, stop = "", None
    for piece in split(text, cuts):
        result = matcher.push(piece)
        emitted += result.text
        if result.stop is not None:
            stop = result.stop
            break
    if stop is None:
        emitted += matcher.flush()
    assert (emitted, stop) == first_stop(text, list(dict.fromkeys(stops)))


# -- detokenizer -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.mark.model
@with_fixture(150)
@given(
    ids=st.lists(st.integers(min_value=17, max_value=49151), min_size=1, max_size=24),
    cuts=st.lists(st.integers(min_value=0, max_value=100), max_size=6),
)
def test_detokenized_deltas_join_into_the_decode(
    tokenizer: Tokenizer, ids: list[int], cuts: list[int]
) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.push(piece) for piece in split(ids, cuts)) + detokenizer.flush()
    assert text == tokenizer.decode(ids, skip_special_tokens=True)


# -- tool calls and reasoning ----------------------------------------------------------------------------

TOOLS = ToolSet((Tool("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),))
# An output: plain text (no marker can form from its characters) and calls, in any order.
PARTS = st.lists(
    st.one_of(
        st.text(alphabet="ab <>/_\n{}", max_size=12).map(lambda text: ("text", text)),
        st.text(alphabet="abc xyz", max_size=8).map(lambda city: ("call", city)),
    ),
    max_size=5,
)


def rendered(parts: list[tuple[str, str]]) -> str:
    return "".join(
        f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps({"city": value})}}}</tool_call>'
        if kind == "call"
        else value
        for kind, value in parts
    )


def calls_and_text(events: list[ParseEvent]) -> tuple[str, list[tuple[str, str]], dict[int, str]]:
    """The text, the calls (name, whole arguments) and each call's streamed arguments joined."""
    text, calls, streamed = "", [], dict[int, str]()
    for event in events:
        if isinstance(event, TextPiece):
            text += event.text
        elif isinstance(event, CallStarted):
            calls.append((event.name, ""))
        elif isinstance(event, CallArguments):
            streamed[event.call_index] = streamed.get(event.call_index, "") + event.fragment
        elif isinstance(event, CallEnded):
            calls[event.call_index] = (calls[event.call_index][0], event.arguments)
    return text, calls, streamed


@SETTINGS
@given(parts=PARTS, cuts=st.lists(st.integers(min_value=0, max_value=300), max_size=10))
def test_tool_calls_parse_the_same_whatever_the_split(parts: list[tuple[str, str]], cuts: list[int]) -> None:
    output = rendered(parts)
    whole = CallParser(HERMES, TOOLS)
    expected = calls_and_text(whole.push(output) + whole.finish())
    cities = [value for kind, value in parts if kind == "call"]  # every call found, with its arguments
    assert [(name, json.loads(arguments)) for name, arguments in expected[1]] == [
        ("get_weather", {"city": city}) for city in cities
    ]
    pieces = CallParser(HERMES, TOOLS)
    events: list[ParseEvent] = []
    for piece in split(output, cuts):
        events += pieces.push(piece)
    assert calls_and_text(events + pieces.finish()) == expected


@SETTINGS
@given(
    opened=st.booleans(),
    output=st.lists(st.sampled_from([START, END, "a", " ", "\n", "<", "/", "think", ">"]), max_size=12).map(
        "".join
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=100), max_size=8),
)
def test_reasoning_splits_the_same_whatever_the_split(opened: bool, output: str, cuts: list[int]) -> None:
    def parsed(pieces: list[str]) -> tuple[str, str]:
        parser, reasoning, answer = ReasoningParser(opened=opened), "", ""
        for piece in [p for text in pieces for p in parser.push(text)] + parser.finish():
            if isinstance(piece, ReasoningPiece):
                reasoning += piece.text
            elif isinstance(piece, AnswerPiece):
                answer += piece.text
        return reasoning, answer

    assert parsed(split(output, cuts)) == parsed([output])


# -- request bodies --------------------------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=12,
)
FIELDS = ("model", "messages", "prompt", "input", "max_tokens", "max_output_tokens", "stream", "tools", "n")
BODY = st.one_of(
    JSON,
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6),
    st.fixed_dictionaries(
        {
            "model": st.just(MODEL_NAME),
            "messages": st.lists(st.dictionaries(st.sampled_from(["role", "content"]), JSON)),
        }
    ),
)
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@pytest.fixture
async def client(model_dir: Path) -> AsyncIterator[httpx.AsyncClient]:
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = FakeBackend(identity_for(model_dir).tokenizer_fingerprint, max_model_len=256)
    fake.script = scripted([[19556]])
    config = make_config(max_input_tokens=200, max_output_tokens=16, default_max_output_tokens=8)
    app = make_app(tokenizer, fake, identity_for(model_dir), config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as made:
        yield made


@pytest.mark.model
@with_fixture(120)
@given(route=st.sampled_from(ROUTES), body=BODY, raw=st.one_of(st.none(), st.binary(max_size=40)))
async def test_no_body_is_a_server_error(
    client: httpx.AsyncClient, route: str, body: Any, raw: bytes | None
) -> None:
    content = raw if raw is not None else json.dumps(body).encode()
    reply = await client.post(route, content=content, headers={"content-type": "application/json"})
    assert reply.status_code < 500, (route, content, reply.text)
    if reply.status_code >= 400:
        error = reply.json()
        assert (error["type"] == "error") if route == "/v1/messages" else ("error" in error), error
