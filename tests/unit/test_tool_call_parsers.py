"""Property tests of the tool call parsers and grammars (issue 24), seeded random splits: every call format's
`CallParser` and the `ReasoningParser` give the same result however the text is cut into stream chunks; text
around a call is kept; in `auto` a call that is not a valid call of an offered tool comes back as text,
verbatim; a forced call's arguments stream as JSON prefixes. The grammars compile over SmolLM2's tokenizer
and their matchers accept a valid call and refuse what may not be generated."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from services.codec.text.reasoning import AnswerPiece, ReasoningParser, ReasoningPiece, thinking_grammar
from services.codec.text.tool_calls import (
    HERMES,
    JSON_FORM,
    LLAMA3,
    CallArguments,
    CallEnded,
    CallFormat,
    CallStarted,
    TextPiece,
    Tool,
    ToolChoice,
    ToolChoiceMode,
    ToolSet,
)
from services.common.grammar import GrammarCompiler, GrammarKind, GrammarSpec

CASES = 200
FORMATS = {f.name: f for f in (JSON_FORM, HERMES, LLAMA3)}
CITY_UNIT = {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}
WEATHER = {"type": "object", "properties": CITY_UNIT, "required": ["city"]}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a"],
}
TOOLS = (Tool("get_weather", WEATHER), Tool("add", ADD), Tool("noop", {"type": "object"}))
# Text that is no call but looks like the start of one, or of JSON; never a whole marker.
TEXT_ALPHABET = [
    " ",
    "\n",
    "a",
    "Z",
    "é",
    "{",
    "}",
    '"',
    ";",
    "<",
    ">",
    "<tool",
    "<|python",
    "</think",
    "<thi",
]


def toolset(mode: ToolChoiceMode, name: str | None = None, parallel: bool = True) -> ToolSet:
    return ToolSet(TOOLS, ToolChoice(mode, name, parallel))


AUTO, REQUIRED = toolset(ToolChoiceMode.AUTO), toolset(ToolChoiceMode.REQUIRED)


def random_arguments(rng: random.Random) -> tuple[str, dict[str, Any]]:
    name = rng.choice(["get_weather", "add", "noop"])
    if name == "get_weather":
        city = "".join(rng.choice(["P", "a", " ", "}", "{", '"', "\\", ";", "é", "\n"]) for _ in range(6))
        arguments: dict[str, Any] = {"city": city} | (
            {"unit": rng.choice("cf")} if rng.random() < 0.5 else {}
        )
    elif name == "add":
        arguments = {"a": rng.randint(-99, 99), "b": rng.randint(0, 9)}
    else:
        arguments = {} if rng.random() < 0.5 else {"nested": {"list": [1, {"x": "]"}]}}
    return name, arguments


def call_text(fmt: CallFormat, calls: list[tuple[str, dict[str, Any]]], *, compact: bool = False) -> str:
    separators = (",", ":") if compact else None
    bodies = [
        json.dumps({"name": name, fmt.arguments_key: args}, separators=separators, ensure_ascii=False)
        for name, args in calls
    ]
    if fmt.end is None:
        return fmt.start + fmt.separator.join(bodies)
    return fmt.separator.join(f"{fmt.start}\n{body}\n{fmt.end}" for body in bodies)


def random_text(rng: random.Random, size: int) -> str:
    return "".join(rng.choice(TEXT_ALPHABET) for _ in range(size))


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if text else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


@dataclass
class ParsedCall:
    name: str
    call_id: str
    fragments: list[str] = field(default_factory=list)
    arguments: str | None = None


@dataclass
class Parsed:
    text: str
    calls: list[ParsedCall]

    def summary(self) -> tuple[str, list[tuple[str, Any]]]:
        return self.text, [(c.name, json.loads(c.arguments or "null")) for c in self.calls]


def parse(fmt: CallFormat, tools: ToolSet, chunks: list[str]) -> Parsed:
    parser = fmt.parser(tools)
    events = [event for chunk in chunks for event in parser.push(chunk)] + parser.finish()
    text, calls = "", []
    for event in events:
        if isinstance(event, TextPiece):
            text += event.text
        elif isinstance(event, CallStarted):
            assert event.call_index == len(calls) and event.call_id.startswith("call_")
            calls.append(ParsedCall(event.name, event.call_id))
        elif isinstance(event, CallArguments):
            assert event.call_index == len(calls) - 1 and calls[-1].arguments is None
            calls[-1].fragments.append(event.fragment)
        elif isinstance(event, CallEnded):
            assert event.call_index == len(calls) - 1 and calls[-1].arguments is None
            calls[-1].arguments = event.arguments
    assert all(call.arguments is not None for call in calls), "a call started and never ended"
    assert parser.num_calls == len(calls)
    return Parsed(text, calls)


# ---- call parsers ----


@pytest.mark.parametrize("mode", [ToolChoiceMode.AUTO, ToolChoiceMode.REQUIRED])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_any_split_of_calls_with_text_around_gives_the_same_calls_and_text(
    fmt: str, mode: ToolChoiceMode
) -> None:
    call_format, tools, rng = FORMATS[fmt], toolset(mode), random.Random(f"{fmt}-{mode}")
    for case in range(CASES):
        calls = [random_arguments(rng) for _ in range(rng.randint(1, 3))]
        before = random_text(rng, rng.randint(0, 6))
        # After the calls: text (not a separator) where a call has an end marker; llama3's run to the end.
        after = rng.choice(["x", " ", "."]) + random_text(rng, rng.randint(0, 6))
        after = after if call_format.end is not None else ""
        text = before + call_text(call_format, calls, compact=rng.random() < 0.5) + after
        chunks = splits(text, rng)
        got = parse(call_format, tools, chunks)
        assert got.summary() == (before + after, calls), (case, chunks)
        assert [c.name for c in got.calls] == [name for name, _ in calls]
        assert got.summary() == parse(call_format, tools, [text]).summary()


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_text_that_only_looks_like_a_call_is_kept_whole(fmt: str) -> None:
    rng = random.Random(fmt)
    for _ in range(CASES):
        text = random_text(rng, rng.randint(1, 20))
        for tools in (AUTO, REQUIRED):
            got = parse(FORMATS[fmt], tools, splits(text, rng))
            assert (got.text, got.calls) == (text, [])


INVALID = {
    "bad json": '{"name": "add", "arguments": {"a": 1}',
    "unknown tool": '{"name": "launch", "arguments": {"a": 1}}',
    "schema fails": '{"name": "add", "arguments": {"a": "one"}}',
    "missing required": '{"name": "get_weather", "arguments": {"unit": "c"}}',
    "arguments not an object": '{"name": "add", "arguments": [1]}',
    "extra key": '{"name": "add", "arguments": {"a": 1}, "why": "x"}',
}


@pytest.mark.parametrize("case", sorted(INVALID))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_invalid_call_in_auto_comes_back_as_text_verbatim(fmt: str, case: str) -> None:
    call_format, rng = FORMATS[fmt], random.Random(f"{fmt}-{case}")
    body = INVALID[case]
    if call_format.arguments_key == "parameters":
        body = body.replace('"arguments"', '"parameters"')
    if call_format.end is None:
        text = "Sure: " + call_format.start + body
    else:
        text = f"Sure: {call_format.start}\n{body}\n{call_format.end}\nthen more"
    for _ in range(CASES // 4):
        assert parse(call_format, AUTO, splits(text, rng)).summary() == (text, [])


@pytest.mark.parametrize("fmt", ["json", "hermes"])
def test_a_call_without_its_end_marker_at_finish_is_text_verbatim(fmt: str) -> None:
    rng = random.Random(fmt)
    for _ in range(CASES // 4):
        text = "ok " + call_text(FORMATS[fmt], [random_arguments(rng)])[: -rng.randint(1, 12)]
        assert parse(FORMATS[fmt], AUTO, splits(text, rng)).summary() == (text, [])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forced_arguments_stream_as_growing_json_prefixes(fmt: str) -> None:
    call_format, rng = FORMATS[fmt], random.Random(f"forced-{fmt}")
    for case in range(CASES):
        calls = [random_arguments(rng) for _ in range(rng.randint(1, 3))]
        text = call_text(call_format, calls, compact=rng.random() < 0.5)
        chunks = list(text) if case % 10 == 0 else splits(text, rng)
        got = parse(call_format, REQUIRED, chunks)
        assert [(c.name, json.loads(c.arguments or "")) for c in got.calls] == calls, (case, chunks)
        for call in got.calls:
            assert "".join(call.fragments) == call.arguments
            assert all(call.fragments), "an empty fragment"
            streamed = ""
            for fragment in call.fragments:
                streamed += fragment  # every prefix of valid JSON is a JSON prefix: only the wrapper isn't
                assert (call.arguments or "").startswith(streamed)
            if len(chunks) == len(text):  # character by character: the arguments come in many pieces
                assert len(call.fragments) > 1


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("mode", [ToolChoiceMode.AUTO, ToolChoiceMode.REQUIRED])
def test_parallel_calls_get_indices_in_order_and_their_own_ids(fmt: str, mode: ToolChoiceMode) -> None:
    calls = [("add", {"a": n}) for n in range(4)]
    got = parse(FORMATS[fmt], toolset(mode), list(call_text(FORMATS[fmt], calls)))
    assert got.summary() == ("", calls)
    assert len({call.call_id for call in got.calls}) == 4


@pytest.mark.parametrize("mode", [ToolChoiceMode.AUTO, ToolChoiceMode.REQUIRED])
def test_llama3_calls_end_at_finish(mode: ToolChoiceMode) -> None:
    text = call_text(LLAMA3, [("get_weather", {"city": "a;b}"}), ("add", {"a": 2})])
    parser = LLAMA3.parser(toolset(mode))
    before = [event for char in text for event in parser.push(char)]
    ended = [event for event in before if isinstance(event, CallEnded)]
    assert [json.loads(event.arguments) for event in ended] == [{"city": "a;b}"}]  # ";" in a string: no cut
    after = parser.finish()
    assert [json.loads(e.arguments) for e in after if isinstance(e, CallEnded)] == [{"a": 2}]
    assert not any(isinstance(event, TextPiece) for event in before + after)


@pytest.mark.parametrize("fmt", ["json", "hermes"])
def test_an_end_marker_inside_an_argument_string_does_not_end_the_call(fmt: str) -> None:
    text = call_text(FORMATS[fmt], [("get_weather", {"city": "a</tool_call>b"})])
    for tools in (AUTO, REQUIRED):
        for chunks in ([text], list(text)):
            got = parse(FORMATS[fmt], tools, chunks)
            assert got.summary() == ("", [("get_weather", {"city": "a</tool_call>b"})])


def test_llama3_text_of_an_invalid_second_call_is_only_what_was_written() -> None:
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1}};{"name": "launch", "parameters": {}}'
    got = parse(LLAMA3, AUTO, [text])
    assert [call.name for call in got.calls] == ["add"]
    assert got.text in text, got.text


# ---- reasoning ----


def split_reasoning(chunks: list[str], *, opened: bool) -> tuple[str, str]:
    parser = ReasoningParser(opened=opened)
    pieces = [piece for chunk in chunks for piece in parser.push(chunk)] + parser.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningPiece))
    return reasoning, "".join(p.text for p in pieces if isinstance(p, AnswerPiece))


@pytest.mark.parametrize("opened", [False, True])
def test_any_split_of_a_thinking_block_gives_the_same_reasoning_and_answer(opened: bool) -> None:
    rng = random.Random(f"think-{opened}")
    for case in range(CASES):
        reasoning = random_text(rng, rng.randint(0, 12)).replace("</think>", "</thinks>")
        answer = random_text(rng, rng.randint(0, 12))
        lead = rng.choice(["", " ", "\n"]) if not opened else ""
        text = ("" if opened else lead + "<think>") + reasoning + "</think>" + answer
        chunks = splits(text, rng)
        # The blank lines right after the block are no part of the answer, however they arrive.
        assert split_reasoning(chunks, opened=opened) == (reasoning, answer.lstrip("\n")), (case, chunks)


def test_output_without_a_thinking_block_is_all_answer() -> None:
    rng = random.Random("no-think")
    for _ in range(CASES):
        text = rng.choice(["A", "{", "<thin"]) + random_text(rng, rng.randint(0, 12))
        if text.lstrip().startswith("<think>"):
            continue
        assert split_reasoning(splits(text, rng), opened=False) == ("", text)


# ---- grammars, over SmolLM2's tokenizer ----

SMOLLM2_EOS = 2
CALL = {"city": "Paris", "unit": "c"}


@pytest.fixture(scope="module")
def compiler(model_dir: Path) -> GrammarCompiler:
    return GrammarCompiler((model_dir / "tokenizer.json").read_text(encoding="utf-8"), [SMOLLM2_EOS])


def grammar_cases() -> dict[str, tuple[ToolSet, GrammarSpec | None]]:
    schema = GrammarSpec.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    return {
        "required": (REQUIRED, None),
        "required one call": (toolset(ToolChoiceMode.REQUIRED, parallel=False), None),
        "named": (toolset(ToolChoiceMode.NAMED, "get_weather"), None),
        "none": (toolset(ToolChoiceMode.NONE), None),
        "auto + json_schema": (AUTO, schema),
        "auto + json_object": (AUTO, GrammarSpec(GrammarKind.JSON_OBJECT)),
    }


@pytest.mark.model
@pytest.mark.parametrize("case", sorted(grammar_cases()))
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_each_tool_grammar_compiles_over_smollm2(compiler: GrammarCompiler, fmt: str, case: str) -> None:
    tools, response = grammar_cases()[case]
    spec = FORMATS[fmt].grammar(tools, response)
    assert spec is not None and spec.kind is GrammarKind.LARK
    compiler.compile(spec)
    assert FORMATS[fmt].grammar(AUTO) is None  # auto alone: free text


def tokens(compiler: GrammarCompiler, text: str) -> list[int]:
    return list(compiler.tokenizer.tokenize_str(text))


def steps(compiler: GrammarCompiler, spec: GrammarSpec | None, ids: list[int]) -> int:
    """How many of `ids` a fresh matcher takes one at a time, as the sampler's masks would let through."""
    assert spec is not None
    matcher = compiler.matcher(spec)
    for count, token_id in enumerate(ids):
        if token_id == SMOLLM2_EOS and matcher.is_accepting():
            return count + 1  # the end (a stopped matcher, one that only EOS may follow, refuses EOS itself)
        if matcher.validate_tokens([token_id]) != 1:
            return count
        assert matcher.consume_token(token_id) and not matcher.is_error()
    return len(ids)


@pytest.mark.model
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_forcing_matchers_take_a_valid_call_and_refuse_anything_else(
    compiler: GrammarCompiler, fmt: str
) -> None:
    call_format = FORMATS[fmt]
    text = call_text(call_format, [("get_weather", CALL)], compact=True)
    ids, named = [*tokens(compiler, text), SMOLLM2_EOS], toolset(ToolChoiceMode.NAMED, "get_weather")
    for tools in (REQUIRED, named):
        spec = call_format.grammar(tools)
        assert steps(compiler, spec, ids) == len(ids)
        for before in ("Sure", " ", "\n"):
            assert steps(compiler, spec, tokens(compiler, before + text)) == 0, before
        assert steps(compiler, spec, [SMOLLM2_EOS]) == 0  # no call is no answer
    assert parse(call_format, REQUIRED, list(text)).summary() == ("", [("get_weather", CALL)])
    other = tokens(compiler, call_text(call_format, [("add", {"a": 3})], compact=True))
    assert steps(compiler, call_format.grammar(named), other) < len(other)


@pytest.mark.model
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_auto_with_a_response_format_takes_a_call_or_an_object(compiler: GrammarCompiler, fmt: str) -> None:
    spec = FORMATS[fmt].grammar(AUTO, GrammarSpec.json_schema({"type": "object", "required": ["x"]}))
    for text in ('{"x":1}', call_text(FORMATS[fmt], [("add", {"a": 3})], compact=True)):
        ids = [*tokens(compiler, text), SMOLLM2_EOS]
        assert steps(compiler, spec, ids) == len(ids), text
    assert steps(compiler, spec, tokens(compiler, "Hello")) == 0


@pytest.mark.model
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_the_none_matcher_masks_the_marker(compiler: GrammarCompiler, fmt: str) -> None:
    spec = FORMATS[fmt].grammar(toolset(ToolChoiceMode.NONE))
    plain = [*tokens(compiler, 'It is sunny in Paris {"a": 1} <tool'), SMOLLM2_EOS]
    assert steps(compiler, spec, plain) == len(plain)
    marked = tokens(compiler, "Let me check. " + FORMATS[fmt].start)
    assert steps(compiler, spec, marked) < len(marked)


@pytest.mark.model
def test_a_thinking_budget_of_8_forces_the_end_of_thinking(compiler: GrammarCompiler) -> None:
    word = tokens(compiler, " a")
    assert len(word) == 1
    spec = thinking_grammar(None, 8, opened=True)
    assert steps(compiler, spec, word * 9) == 8  # the 9th thinking token is refused
    end = word * 8 + tokens(compiler, "</think>The answer")
    assert steps(compiler, spec, end) == len(end)
    opening = tokens(compiler, "<think>")
    assert steps(compiler, thinking_grammar(None, 8, opened=False), opening + word * 9) == len(opening) + 8


@pytest.mark.model
def test_thinking_may_end_before_its_budget(compiler: GrammarCompiler) -> None:
    spec = thinking_grammar(None, 100, opened=True)
    ids = tokens(compiler, " a") * 3 + tokens(compiler, "</think>") + tokens(compiler, "The answer")
    assert steps(compiler, spec, ids) == len(ids)


@pytest.mark.model
def test_a_forced_call_starts_right_after_the_thinking_block(compiler: GrammarCompiler) -> None:
    spec = thinking_grammar(JSON_FORM.grammar(REQUIRED), 8, opened=True)
    thought = tokens(compiler, " a") * 8 + tokens(compiler, "</think>")
    call = tokens(compiler, call_text(JSON_FORM, [("add", {"a": 1})], compact=True))
    assert steps(compiler, spec, thought + call) == len(thought + call)
    prose = tokens(compiler, "Sure")
    assert steps(compiler, spec, thought + prose) == len(thought)
