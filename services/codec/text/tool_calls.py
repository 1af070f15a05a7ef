"""Tool calls in the model's own words: the tools a request offers, how a model family writes a call, the
grammar that forces or forbids one, and a streaming parser that turns the model's text back into calls.

Each protocol turns its tool fields into one `ToolSet` (tools + `ToolChoice`); from here on nothing is
protocol-specific. A family's `CallFormat` says how a call looks in the generated text:

    json / hermes   <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>   (several: one per block)
    llama3          <|python_tag|>{"name": "f", "parameters": {...}}                (several: joined by ";")

`hermes` is Qwen's form, where `<tool_call>` and `</tool_call>` are single tokens of the vocabulary;
`json` is the same text for a model without them (SmolLM2, Gemma 3): it reaches the prompt through a
tool-aware template shipped in text/templates/ (services/codec/text/templates.py) and is matched by a
held-back match on the marker's text. Where the marker is one token of the vocabulary, grammars name it
by token ID (`<[id]>`), so a forced call starts with exactly that token.

Tool choice, enforced by the grammar engine (services/common/grammar.py, llguidance) in the engine:

    none       no tools in the prompt, and the call marker masked (a regex that excludes it)
    auto       no constraint; a call that is not valid JSON for its tool's schema comes back as text
    required   a grammar that is one call (or several, with parallel calls) of any offered tool
    named      a grammar that is one call of that tool

`auto` with a response format is "a call or an object of that schema". Under a forcing grammar a call's
arguments stream as they come (the grammar makes them valid); under `auto` a call is held back whole,
checked against its schema, and only then sent.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import jsonschema

from services.codec.text.stop_strings import partial_match_len
from services.common.errors import InvalidRequestError
from services.common.grammar import GrammarKind, GrammarSpec

MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")


class ToolChoiceMode(StrEnum):
    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Mapping[str, Any]
    description: str | None = None
    strict: bool = False

    def template_form(self) -> dict[str, Any]:
        """The tool as Hugging Face chat templates expect it (OpenAI's Chat shape)."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None  # NAMED only
    parallel: bool = True
    allowed: tuple[str, ...] | None = None  # OpenAI's allowed_tools: calls only to these (AUTO or REQUIRED)


@dataclass(frozen=True)
class ToolSet:
    """The tools of one request and how the model may use them. `param` names the request's tools field,
    `choice_param` its tool choice field, for the 400s."""

    tools: tuple[Tool, ...]
    choice: ToolChoice = field(default_factory=ToolChoice)
    param: str = "tools"
    choice_param: str = "tool_choice"

    def __post_init__(self) -> None:
        if len(self.tools) > MAX_TOOLS:
            raise InvalidRequestError(f"at most {MAX_TOOLS} tools, got {len(self.tools)}", self.param)
        seen: set[str] = set()
        for index, tool in enumerate(self.tools):
            where = f"{self.param}[{index}]"
            if not TOOL_NAME.match(tool.name):
                raise InvalidRequestError(
                    f"tool name {tool.name[:80]!r} must be 1-64 letters, digits, _ . : or -", f"{where}.name"
                )
            if tool.name in seen:
                raise InvalidRequestError(f"two tools are named {tool.name!r}", f"{where}.name")
            seen.add(tool.name)
            if not isinstance(tool.parameters, Mapping) or tool.parameters.get("type", "object") != "object":
                raise InvalidRequestError("a tool's parameters must be a JSON schema of an object", where)
            try:
                jsonschema.validators.validator_for(tool.parameters).check_schema(tool.parameters)
            except jsonschema.SchemaError as exc:
                raise InvalidRequestError(
                    f"tool {tool.name!r} has an invalid schema: {exc.message}", where
                ) from None
        for name in self.choice.allowed or ():
            if name not in seen:
                raise InvalidRequestError(
                    f"allowed_tools names {name!r}, which is not a tool", self.choice_param
                )
        if self.choice.mode is ToolChoiceMode.NAMED and self.choice.name not in seen:
            raise InvalidRequestError(
                f"tool_choice names {self.choice.name!r}, which is not a tool", self.choice_param
            )
        if self.choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED) and not self.tools:
            raise InvalidRequestError("tool_choice forces a call, but no tools are given", self.choice_param)

    @property
    def is_active(self) -> bool:
        """Whether calls are parsed from the output (tools offered, and choice not `none`)."""
        return bool(self.tools) and self.choice.mode is not ToolChoiceMode.NONE

    @property
    def is_forced(self) -> bool:
        return self.choice.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)

    def tool(self, name: str) -> Tool | None:
        return next((tool for tool in self.tools if tool.name == name), None)

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template gets as `tools` (none under tool_choice none, as vLLM does by default)."""
        return [tool.template_form() for tool in self.tools] if self.is_active else None

    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools a call may name: the named one, else the allowed ones, else all."""
        if self.choice.mode is ToolChoiceMode.NAMED:
            return tuple(tool for tool in self.tools if tool.name == self.choice.name)
        if self.choice.allowed is not None:
            return tuple(tool for tool in self.tools if tool.name in self.choice.allowed)
        return self.tools


@dataclass(frozen=True)
class CallFormat:
    """How one model family writes a call. `start_id`/`end_id`: the markers' token IDs when each is one
    token of the vocabulary (then grammars name the token, not its text)."""

    name: str
    start: str
    end: str | None  # None: a call runs to the end of the output
    arguments_key: str = "arguments"
    separator: str = "\n"  # between two calls
    start_id: int | None = None
    end_id: int | None = None

    def with_token_ids(self, token_id_of: Mapping[str, int]) -> CallFormat:
        return CallFormat(
            self.name,
            self.start,
            self.end,
            self.arguments_key,
            self.separator,
            token_id_of.get(self.start),
            token_id_of.get(self.end) if self.end is not None else None,
        )

    # ---- grammars ----

    def grammar(self, tools: ToolSet, response_schema: GrammarSpec | None = None) -> GrammarSpec | None:
        """The constraint for `tools`' choice: forced calls, the marker masked, or None (auto, free)."""
        mode = tools.choice.mode
        if mode is ToolChoiceMode.NONE or (not tools.tools and response_schema is None):
            return self._masked_marker() if tools.tools and response_schema is None else None
        if mode is ToolChoiceMode.AUTO:
            if response_schema is None:
                return None
            return GrammarSpec(GrammarKind.LARK, self._calls_lark(tools, response_schema))
        return GrammarSpec(GrammarKind.LARK, self._calls_lark(tools, None))

    def _calls_lark(self, tools: ToolSet, alternative: GrammarSpec | None) -> str:
        bodies = [self._body_schema(tool) for tool in tools.callable_tools()]
        lines = ["start: calls" if alternative is None else "start: calls | object_answer"]
        if alternative is not None:
            lines.append(f"object_answer: {_alternative_lark(alternative)}")
        start = _marker(self.start, self.start_id)
        if self.end is None:  # one marker, then calls joined by the separator
            repeat = f" ({_lark_literal(self.separator)} body)*" if tools.choice.parallel else ""
            lines.append(f"calls: {start} body{repeat}")
        else:
            repeat = f" ({_lark_literal(self.separator)} call)*" if tools.choice.parallel else ""
            lines.append(f"calls: call{repeat}")
            end = _marker(self.end, self.end_id)
            lines.append(f'call: {start} "\\n" body "\\n" {end}')
        lines.append("body: " + " | ".join(f"body{index}" for index in range(len(bodies))))
        lines += [f"body{index}: %json {json.dumps(schema)}" for index, schema in enumerate(bodies)]
        return "\n".join(lines)

    def _body_schema(self, tool: Tool) -> dict[str, Any]:
        return {
            "type": "object",
            "properties": {"name": {"const": tool.name}, self.arguments_key: dict(tool.parameters)},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
            "x-guidance": {"whitespace_flexible": False, "lenient": not tool.strict},
        }

    def _masked_marker(self) -> GrammarSpec:
        """Any text that does not hold the call marker (nor, being text, any special token)."""
        marker = re.escape(self.start).replace("/", "\\/")
        return GrammarSpec(GrammarKind.LARK, f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{marker}.*)/")

    def parser(self, tools: ToolSet) -> CallParser:
        return CallParser(self, tools)


def _marker(text: str, token_id: int | None) -> str:
    return f"<[{token_id}]>" if token_id is not None else _lark_literal(text)


def _lark_literal(text: str) -> str:
    return json.dumps(text)


def _alternative_lark(spec: GrammarSpec) -> str:
    if spec.kind is GrammarKind.JSON_OBJECT:
        return '%json {"type": "object"}'
    if spec.kind is GrammarKind.JSON_SCHEMA:
        return f"%json {spec.text}"
    raise InvalidRequestError(
        "with tools, a response format must be a JSON schema or json_object", "response_format"
    )


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>")
JSON_FORM = CallFormat("json", "<tool_call>", "</tool_call>")
LLAMA3 = CallFormat("llama3", "<|python_tag|>", None, arguments_key="parameters", separator=";")
FORMATS = {f.name: f for f in (HERMES, JSON_FORM, LLAMA3)}


def detect_format(token_id_of: Mapping[str, int], configured: str = "auto") -> CallFormat:
    """The call format for a vocabulary (`token_id_of`: a token's text → its ID, for single tokens):
    configured, else Qwen's markers, else Llama 3's, else the JSON form of the shipped templates."""
    if configured != "auto":
        return FORMATS[configured].with_token_ids(token_id_of)
    if "<tool_call>" in token_id_of and "</tool_call>" in token_id_of:
        return HERMES.with_token_ids(token_id_of)
    if "<|python_tag|>" in token_id_of:
        return LLAMA3.with_token_ids(token_id_of)
    return JSON_FORM


# ---- parsing ----


@dataclass(frozen=True)
class TextPiece:
    text: str


@dataclass(frozen=True)
class CallStarted:
    call_index: int
    call_id: str  # the codec's `call_<24 hex>`; protocols with their own prefix re-key it
    name: str


@dataclass(frozen=True)
class CallArguments:
    call_index: int
    fragment: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallEnded:
    call_index: int
    arguments: str  # the whole arguments JSON text


ParseEvent = TextPiece | CallStarted | CallArguments | CallEnded

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')


class CallParser:
    """Splits one sample's streamed text into text and calls. `push` takes each new piece of text and
    returns what is now certain; `finish` what is left at the end. Text that could still be the start of
    a call marker is held back, as a stop string's start is."""

    def __init__(self, call_format: CallFormat, tools: ToolSet) -> None:
        self._format = call_format
        self._tools = tools
        self._trusted = tools.is_forced  # the grammar made the calls: stream their arguments
        self._held = ""  # text not yet certain (a marker's start) or a call being read
        self._in_call = False
        self._after_call = False  # just past a call: a separator here is no text
        self._opening = ""
        self._num_calls = 0
        self._streamer: _ArgumentStreamer | None = None

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def push(self, text: str) -> list[ParseEvent]:
        self._held += text
        events: list[ParseEvent] = []
        while True:
            progressed = self._step_in_call(events) if self._in_call else self._step_in_text(events)
            if not progressed:
                return events

    def finish(self) -> list[ParseEvent]:
        """The end of the output: a call without its end marker ends here (Llama 3's ends at EOS)."""
        events: list[ParseEvent] = []
        if self._in_call:
            self._close_call(self._held, events, complete=self._format.end is None)
        elif self._held:
            events.append(TextPiece(self._held))
        self._held = ""
        self._in_call = False
        return events

    def _step_in_text(self, events: list[ParseEvent]) -> bool:
        if self._after_call:
            separator = self._format.separator
            if self._held.startswith(separator):
                self._held = self._held[len(separator) :]
            elif separator.startswith(self._held):
                return False  # too little yet to tell
            self._after_call = False
        start = self._format.start
        at = self._held.find(start)
        if at >= 0:
            if at:
                events.append(TextPiece(self._held[:at]))
            self._held = self._held[at + len(start) :]
            self._in_call = True
            self._opening = start  # what began this call, given back if it turns out to be text
            self._streamer = None
            return True
        keep = partial_match_len(self._held, (start,))
        if len(self._held) > keep:
            events.append(TextPiece(self._held[: len(self._held) - keep]))
            self._held = self._held[len(self._held) - keep :]
        return False

    def _step_in_call(self, events: list[ParseEvent]) -> bool:
        end = self._format.end
        if end is None:  # llama3: calls joined by ";" run to the end of the output
            body, sep, rest = _split_top_level(self._held, self._format.separator)
            if sep:
                self._stream_arguments(body, events)  # forced: the call's pieces first, as if streamed
                self._close_call(body, events, complete=True)
                self._held = rest
                self._in_call = True  # the next call follows the separator, without a marker
                self._opening = sep
                return True
            self._stream_arguments(self._held, events)
            return False
        at = _find_outside_strings(self._held, end)  # a marker inside an argument string is text
        if at < 0:
            self._stream_arguments(self._held, events)
            return False
        self._stream_arguments(self._held[:at], events)  # forced: the call's pieces first, as if streamed
        self._after_call = self._close_call(self._held[:at], events, complete=True)
        self._held = self._held[at + len(end) :]
        self._in_call = False
        return True

    def _stream_arguments(self, body: str, events: list[ParseEvent]) -> None:
        if not self._trusted:
            return
        if self._streamer is None:
            head = _HEAD.match(body)
            if head is None:
                return
            self._streamer = _ArgumentStreamer(self._num_calls, head.end())
            events.append(CallStarted(self._num_calls, new_call_id(), json.loads(f'"{head.group(1)}"')))
        events.extend(self._streamer.feed(body))

    def _close_call(self, body: str, events: list[ParseEvent], *, complete: bool) -> bool:
        """Ends the call read so far; False when it turned out to be text."""
        streamer, self._streamer = self._streamer, None
        if streamer is not None:  # forced: its arguments already went out
            events.extend(streamer.feed(body))
            events.append(CallEnded(streamer.call_index, streamer.sent))
            self._num_calls += 1
            return True
        call = self._checked_call(body) if complete else None
        if call is None:  # not a call of an offered tool with valid arguments: it is text
            events.append(TextPiece(self._opening + body + (self._format.end or "") * complete))
            return False
        name, arguments = call
        events.append(CallStarted(self._num_calls, new_call_id(), name))
        events.append(CallArguments(self._num_calls, arguments))
        events.append(CallEnded(self._num_calls, arguments))
        self._num_calls += 1
        return True

    def _checked_call(self, body: str) -> tuple[str, str] | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(self._format.arguments_key, value.get("arguments", value.get("parameters")))
        tool = next((t for t in self._tools.callable_tools() if t.name == value["name"]), None)
        if (
            tool is None
            or not isinstance(arguments, dict)
            or set(value) - {"name", self._format.arguments_key}
        ):
            return None
        try:
            jsonschema.validate(arguments, dict(tool.parameters))
        except Exception:  # invalid, or a schema jsonschema cannot follow ($ref): not a call then
            return None
        return tool.name, json.dumps(arguments, ensure_ascii=False)


class _ArgumentStreamer:
    """Sends a forced call's arguments text as it grows: everything from the arguments' first brace up to
    its matching closing brace (tracked through strings and escapes), never the wrapper around it."""

    def __init__(self, call_index: int, start: int) -> None:
        self.call_index = call_index
        self._start = start
        self._scanned = start  # how far into the body the scan has gone
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._done = False
        self.sent = ""

    def feed(self, body: str) -> list[ParseEvent]:
        end = self._scanned
        while end < len(body) and not self._done:
            char = body[end]
            end += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                self._done = self._depth == 0
        fragment = body[self._scanned : end]
        self._scanned = end
        if not self.sent:
            fragment = fragment.lstrip()  # whitespace before the arguments' first brace is no part of them
        self.sent += fragment
        return [CallArguments(self.call_index, fragment)] if fragment else []


class JsonPlace(StrEnum):
    """Where a character of JSON text sits: outside strings (a string's opening quote included), inside
    one, or closing it."""

    OUTSIDE = "outside"
    INSIDE = "inside"
    CLOSE = "close"


def json_places(text: str) -> Iterator[tuple[int, str, JsonPlace]]:
    """Each character of `text` with its place, strings and escapes followed (any text: no validation)."""
    in_string, escaped = False, False
    for index, char in enumerate(text):
        if not in_string:
            in_string = char == '"'
            yield index, char, JsonPlace.OUTSIDE
        elif escaped or char != '"':
            escaped = not escaped and char == "\\"
            yield index, char, JsonPlace.INSIDE
        else:
            in_string = False
            yield index, char, JsonPlace.CLOSE


def _find_outside_strings(text: str, marker: str) -> int:
    """Where `marker` first starts in `text` outside JSON strings; -1 if nowhere."""
    for index, _, place in json_places(text):
        if place is JsonPlace.OUTSIDE and text.startswith(marker, index):
            return index
    return -1


def _split_top_level(text: str, separator: str) -> tuple[str, str, str]:
    """`text` cut at the first `separator` outside JSON strings and brackets (llama3's call separator)."""
    depth = 0
    for index, char, place in json_places(text):
        if place is not JsonPlace.OUTSIDE:
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            return text[:index], separator, text[index + 1 :]
    return text, "", ""


def new_call_id(prefix: str = "call_") -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def single_token_ids(vocab: Mapping[str, int], texts: Sequence[str]) -> dict[str, int]:
    """Of `texts`, those that are one token of `vocab`, with their IDs."""
    return {text: vocab[text] for text in texts if text in vocab}
