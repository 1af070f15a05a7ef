"""Anthropic Messages request schemas: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Parsing is strict: wrong types, out-of-range values and unknown fields fail (400 naming the param).
Fields fall in three groups:
- honoured: model, max_tokens, messages (a final assistant message of text is a prefill), system,
  stop_sequences, stream, temperature, top_p, top_k; metadata.user_id keys the session for routing
  affinity (session.py); output_config.format (json_schema, schemas/structured.py);
  tools (custom tools: name, description, input_schema, strict) and tool_choice (auto / any / tool /
  none, disable_parallel_tool_use), as a `ToolSet` (text/tool_calls.py); `tool_use` blocks in assistant
  messages and `tool_result` blocks in user messages (text, JSON, is_error), for the chat template;
  thinking (enabled with budget_tokens / adaptive / disabled) as a `Thinking` (text/reasoning.py);
  cache_control (top level, on text blocks, tools and tool blocks): at most 4 in a request, 1h ones
  before 5m ones, none on an empty text block (`cache_breakpoints`); the prompt up to each is kept in
  the KV tiers that long (`marked` finds where it ends; anthropic_messages.py);
- accepted and ignored: service_tier, citations on text blocks, inference_geo, speed, diagnostics,
  user_profile_id, workspace_id, output_config.effort, thinking.display, a tool's input_examples,
  defer_loading, eager_input_streaming and allowed_callers; `thinking` and `redacted_thinking` blocks in
  assistant history (they are dropped: the template never shows the model its earlier thinking). On a model
  without a thinking mode (its chat template writes no `<think>`, e.g. SmolLM2) `thinking` is accepted
  and ignored: the reply has no thinking block. Its rules are still checked, as Anthropic checks them:
  budget_tokens >= 1024 and below max_tokens, and no forced tool_choice (any / tool) while thinking;
- defined by Anthropic but not honoured here: they parse, then `check_supported` (or turning the
  messages into template messages) rejects them with UnsupportedParameterError: content blocks other
  than text, tool_use, tool_result and thinking (image, document, server tool results, ...), server
  tools (web_search, bash, text_editor, code_execution, ...), container.

Tool history becomes the template's OpenAI-style messages: an assistant message's `tool_use` blocks its
`tool_calls` (arguments as objects), each `tool_result` block a `{"role": "tool"}` message after it. A
`tool_result` must answer a `tool_use` of an earlier message (else a 400), and a final assistant message
(a prefill) cannot hold a `tool_use`: its result would be missing.
"""

from __future__ import annotations

import json
import typing
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from services.codec.errors import UnsupportedParameterError
from services.codec.protocols.schemas import structured
from services.codec.text.reasoning import Thinking
from services.codec.text.stop_strings import MAX_STOP_STRING_CHARS
from services.codec.text.tool_calls import Tool, ToolChoice, ToolChoiceMode, ToolSet
from services.common.errors import InvalidRequestError
from services.common.grammar import Constraint

MAX_STOP_SEQUENCES = 16  # a server limit: each one is matched against every token's text
MAX_USER_ID_LEN = 256
MIN_THINKING_BUDGET = 1024  # Anthropic's floor for thinking.budget_tokens
MAX_CACHE_BREAKPOINTS = 4  # blocks with cache_control in one request, the top-level one included
MARK = "\ue000"  # a private-use character: text no template writes (PromptFields.marked)
MARK_TOOL = "kvrelay_cache_mark"
_TOOLS, _SYSTEM, _MESSAGES = range(3)  # where a CachePoint is: (_TOOLS, i), (_SYSTEM, i), (_MESSAGES, n, i)


class CachePoint(NamedTuple):
    """One `cache_control`: its param, its ttl ("5m" or "1h"), and where its block is (() for the
    top-level one)."""

    param: str
    ttl: str
    where: tuple[int, ...]


# Block types the API defines that a text-only server cannot take (anthropic 2.14 ContentBlockParam).
UNSUPPORTED_BLOCK_TYPES = Literal[
    "image",
    "document",
    "search_result",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "container_upload",
]
_TOOL_CHOICE_MODES = {
    "auto": ToolChoiceMode.AUTO,
    "any": ToolChoiceMode.REQUIRED,
    "tool": ToolChoiceMode.NAMED,
    "none": ToolChoiceMode.NONE,
}


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None

    @property
    def lifetime(self) -> str:
        return self.ttl or "5m"


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ToolUseBlock(Strict):
    """An assistant's call of a tool, in history."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    caller: dict[str, Any] | None = None  # accepted and ignored
    toolset_name: str | None = None  # accepted and ignored


class ToolResultBlock(Strict):
    """A user's answer to a `tool_use`: a string, text blocks, or (leniently) any JSON value."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: Any = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None  # accepted and ignored

    def text(self, where: str) -> str:
        """The result as the template shows it: text blocks joined, other JSON as JSON text."""
        content = self.content
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            text = "\n".join(_result_part(part, f"{where}.content[{n}]") for n, part in enumerate(content))
        else:
            text = json.dumps(content, ensure_ascii=False)
        return f"Error: {text}" if self.is_error else text


def _result_part(part: Any, where: str) -> str:
    if isinstance(part, dict) and part.get("type") == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"{where}.text must be a string", f"{where}.text")
        return str(part["text"])
    if isinstance(part, dict) and isinstance(part.get("type"), str) and part["type"] in _UNSUPPORTED_NAMES:
        raise UnsupportedParameterError(
            f"{part['type']} content blocks are not supported by this server", where
        )
    return part if isinstance(part, str) else json.dumps(part, ensure_ascii=False)


class ThinkingBlock(Strict):
    """Earlier thinking, in an assistant's history: accepted and dropped."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Strict):
    type: Literal["redacted_thinking"]
    data: str


class UnsupportedBlock(BaseModel):
    """A block this server cannot serve; it parses only so that the error can name its type."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: UNSUPPORTED_BLOCK_TYPES


_UNSUPPORTED_NAMES = frozenset(typing.get_args(UNSUPPORTED_BLOCK_TYPES))
_BLOCK_TAGS = {
    "text": "text_block",
    "tool_use": "tool_use_block",
    "tool_result": "tool_result_block",
    "thinking": "thinking_block",
    "redacted_thinking": "redacted_thinking_block",
}


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return _BLOCK_TAGS.get(kind, "other_block") if isinstance(kind, str) else "other_block"


# Tagged by `type`, with tag names that are no field's name, so that error params stay exact.
ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text_block")]
    | Annotated[ToolUseBlock, Tag("tool_use_block")]
    | Annotated[ToolResultBlock, Tag("tool_result_block")]
    | Annotated[ThinkingBlock, Tag("thinking_block")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking_block")]
    | Annotated[UnsupportedBlock, Tag("other_block")],
    Discriminator(_block_kind),
]


class InputMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def text(self, where: str) -> str:
        """The message's text: a string as is, text blocks joined by newlines (thinking dropped)."""
        if isinstance(self.content, str):
            return self.content
        return _join_text(self.content, f"{where}.content", self.role)

    def to_template(self, index: int, call_ids: set[str]) -> list[dict[str, Any]]:
        """The message as the chat template's messages: an assistant's text with its `tool_use` blocks as
        `tool_calls`; a user's text, with each `tool_result` block a `tool` message of its own (in order).
        `call_ids`: the tool_use ids seen so far (a tool_result must answer one of them)."""
        where = f"messages[{index}]"
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        if self.role == "assistant":
            return [_assistant_message(self.content, where, call_ids)]
        rendered: list[dict[str, Any]] = []
        texts: list[str] = []
        for number, block in enumerate(self.content):
            param = f"{where}.content[{number}]"
            if isinstance(block, ToolResultBlock):
                if block.tool_use_id not in call_ids:
                    raise InvalidRequestError(
                        f"this tool_result answers tool_use_id {block.tool_use_id!r}, which no earlier "
                        "tool_use block has",
                        f"{param}.tool_use_id",
                    )
                if texts:
                    rendered.append({"role": "user", "content": "\n".join(texts)})
                    texts = []
                rendered.append(
                    {"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text(param)}
                )
            elif isinstance(block, TextBlock):
                texts.append(block.text)
            else:
                _refuse(block, param, "user")
        if texts or not rendered:
            rendered.append({"role": "user", "content": "\n".join(texts)})
        return rendered


def _assistant_message(blocks: list[ContentBlock], where: str, call_ids: set[str]) -> dict[str, Any]:
    """An assistant message's text and its tool_use blocks as `tool_calls`; thinking dropped."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for number, block in enumerate(blocks):
        param = f"{where}.content[{number}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": block.input},
                }
            )
            call_ids.add(block.id)
        elif not isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            _refuse(block, param, "assistant")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def _refuse(block: Any, param: str, role: str) -> None:
    if isinstance(block, UnsupportedBlock):
        raise UnsupportedParameterError(
            f"{block.type} content blocks are not supported by this server", param
        )
    raise InvalidRequestError(f"{param}: {block.type} blocks cannot be in a {role} message", param)


class Metadata(Strict):
    user_id: Annotated[str, Field(max_length=MAX_USER_ID_LEN)] | None = None


class ThinkingConfig(Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None  # accepted and ignored

    def check(self, max_tokens: int | None) -> None:
        """Anthropic's rules: `enabled` takes a budget of at least 1024 tokens, below max_tokens; the
        other types take none."""
        if self.type != "enabled":
            if self.budget_tokens is not None:
                raise InvalidRequestError(
                    f"thinking.budget_tokens is only allowed when thinking.type is enabled, not {self.type}",
                    "thinking.budget_tokens",
                )
            return
        if self.budget_tokens is None:
            raise InvalidRequestError(
                "thinking.budget_tokens is required when thinking is enabled", "thinking.budget_tokens"
            )
        if self.budget_tokens < MIN_THINKING_BUDGET:
            raise InvalidRequestError(
                f"thinking.budget_tokens must be at least {MIN_THINKING_BUDGET}, got {self.budget_tokens}",
                "thinking.budget_tokens",
            )
        if max_tokens is not None and self.budget_tokens >= max_tokens:
            raise InvalidRequestError(
                f"max_tokens must be greater than thinking.budget_tokens ({self.budget_tokens}), "
                f"got {max_tokens}",
                "thinking.budget_tokens",
            )


class ToolChoiceParam(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    def to_choice(self) -> ToolChoice:
        if self.type == "tool" and self.name is None:
            raise InvalidRequestError(
                "tool_choice.name is required when tool_choice.type is tool", "tool_choice.name"
            )
        if self.type != "tool" and self.name is not None:
            raise InvalidRequestError(
                f"tool_choice.name is only allowed when tool_choice.type is tool, not {self.type}",
                "tool_choice.name",
            )
        return ToolChoice(
            _TOOL_CHOICE_MODES[self.type], self.name, parallel=not self.disable_parallel_tool_use
        )


class CustomTool(Strict):
    """A client tool: the model calls it, the client runs it."""

    name: str
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    strict: bool | None = None
    # Accepted and ignored.
    cache_control: CacheControl | None = None
    input_examples: list[dict[str, Any]] | None = None
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    allowed_callers: list[str] | None = None


class ServerTool(BaseModel):
    """A tool Anthropic runs itself (web_search, bash, text_editor, ...); parsed only to be refused."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _tool_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "custom_tool" if kind in (None, "custom") else "server_tool"


AnyTool = Annotated[
    Annotated[CustomTool, Tag("custom_tool")] | Annotated[ServerTool, Tag("server_tool")],
    Discriminator(_tool_kind),
]


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: structured.AnthropicFormat | None = None


class PromptFields(Strict):
    """What decides the prompt: the whole of a count_tokens request, and part of a messages one."""

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored.
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def constraint(self) -> Constraint | None:
        """`output_config.format` (json_schema) as a structured output constraint."""
        text_format = self.output_config.format if self.output_config is not None else None
        return structured.pick((structured.from_anthropic_format(text_format), "output_config.format"))

    def check_supported(self) -> None:
        """Raises for the first field this server cannot honour, or a rule of Anthropic's broken."""
        tools = self.toolset()
        if self.thinking is not None:
            self.thinking.check(self._max_tokens())
        if self.thinking_wish().enabled and tools is not None and tools.is_forced:
            raise InvalidRequestError(
                "thinking cannot be enabled while tool_choice forces tool use (any or tool): "
                "use tool_choice auto or none, or turn thinking off",
                "tool_choice",
            )
        self.constraint()
        self.cache_breakpoints()
        prefill = self.prefill_text()
        last = len(self.messages) - 1
        if prefill is not None and prefill != prefill.rstrip():
            where = f"messages[{last}].content"
            raise InvalidRequestError("final assistant content cannot end with trailing whitespace", where)
        self.template_messages()  # a tool_result for no tool_use: a 400 now, before the prompt is rendered

    def _max_tokens(self) -> int | None:
        return None

    def cache_breakpoints(self) -> list[CachePoint]:
        """Each `cache_control`, in the prompt's order (tools, system, messages, then the top-level one,
        which marks the last block); a 400 for more than MAX_CACHE_BREAKPOINTS, a 1h breakpoint after a
        5m one, or one on an empty text block. (On a thinking block it is an unknown field already.)"""
        points: list[CachePoint] = []

        def mark(param: str, control: CacheControl | None, where: tuple[int, ...], block: Any = None) -> None:
            if control is None:
                return
            if isinstance(block, TextBlock) and not block.text:
                raise InvalidRequestError("cache_control cannot be set on an empty text block", param)
            points.append(CachePoint(param, control.lifetime, where))

        for index, tool in enumerate(self.tools or ()):
            if isinstance(tool, CustomTool):
                mark(f"tools[{index}].cache_control", tool.cache_control, (_TOOLS, index))
        for index, text in enumerate(self.system if isinstance(self.system, list) else ()):
            mark(f"system[{index}].cache_control", text.cache_control, (_SYSTEM, index), text)
        for number, message in enumerate(self.messages):
            for index, block in enumerate(message.content if isinstance(message.content, list) else ()):
                where = f"messages[{number}].content[{index}].cache_control"
                mark(where, getattr(block, "cache_control", None), (_MESSAGES, number, index), block)
        mark("cache_control", self.cache_control, ())
        if len(points) > MAX_CACHE_BREAKPOINTS:
            raise InvalidRequestError(
                f"at most {MAX_CACHE_BREAKPOINTS} blocks may carry cache_control (the top-level one "
                f"included); found {len(points)}",
                points[MAX_CACHE_BREAKPOINTS].param,
            )
        after_5m = False
        for param, ttl, _ in points:
            if ttl == "1h" and after_5m:
                raise InvalidRequestError(
                    'a cache_control with ttl "1h" cannot come after one with ttl "5m": put the 1h '
                    "breakpoints first",
                    param,
                )
            after_5m = after_5m or ttl == "5m"
        return points

    def marked(self, point: CachePoint) -> PromptFields | None:
        """A copy of these fields with a marker right after the block that carries `point`: its prompt
        text is the original's up to the breakpoint, then differs. None for the top-level cache_control,
        which marks the whole prompt."""
        if not point.where:
            return None
        copy = self.model_copy(deep=True)
        kind, index, *inner = point.where
        if kind == _TOOLS and copy.tools is not None:
            copy.tools.insert(index + 1, CustomTool(name=MARK_TOOL, input_schema={"type": "object"}))
        elif kind == _SYSTEM and isinstance(copy.system, list):
            copy.system.insert(index + 1, TextBlock(type="text", text=MARK))
        elif kind == _MESSAGES and isinstance(content := copy.messages[index].content, list):
            content.insert(inner[0] + 1, TextBlock(type="text", text=MARK))
        return copy

    def toolset(self) -> ToolSet | None:
        """The offered tools and the choice; a 400 for a tool or a choice that cannot be honoured."""
        choice = self.tool_choice
        if not self.tools and (choice is None or choice.type in ("auto", "none")):
            return None
        tools = []
        for index, tool in enumerate(self.tools or ()):
            if isinstance(tool, ServerTool):
                raise UnsupportedParameterError(
                    f"{tool.type} tools are not supported by this server: only custom tools (with an "
                    "input_schema) are",
                    f"tools[{index}]",
                )
            if tool.input_schema.get("type", "object") != "object":
                raise InvalidRequestError(
                    "input_schema must be a JSON schema of an object (type: object)",
                    f"tools[{index}].input_schema",
                )
            tools.append(Tool(tool.name, tool.input_schema, tool.description, bool(tool.strict)))
        mode = choice.to_choice() if choice is not None else ToolChoice(ToolChoiceMode.AUTO)
        return ToolSet(tuple(tools), mode, "tools", "tool_choice")

    def thinking_wish(self) -> Thinking:
        """`thinking` as a `Thinking`: off unless asked for, as on Anthropic's API."""
        config = self.thinking
        if config is None or config.type == "disabled":
            return Thinking(False)
        return Thinking(True, config.budget_tokens if config.type == "enabled" else None)

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template: `system` first, then every message except a
        final assistant one of text (the prefill, see `prefill_text`)."""
        rendered: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else _join_text(self.system, "system")
            rendered.append({"role": "system", "content": system})
        history = self.messages[:-1] if self.prefill_text() is not None else self.messages
        call_ids: set[str] = set()
        for index, message in enumerate(history):
            rendered += message.to_template(index, call_ids)
        return rendered

    def prefill_text(self) -> str | None:
        """The final assistant message's text, which the reply continues; None if the last is a user's.
        A final assistant `tool_use` is a 400: the tool_result it needs can only come after it."""
        last = self.messages[-1]
        if last.role != "assistant":
            return None
        where = f"messages[{len(self.messages) - 1}]"
        if not isinstance(last.content, str):
            for number, block in enumerate(last.content):
                if isinstance(block, ToolUseBlock):
                    param = f"{where}.content[{number}]"
                    raise InvalidRequestError(
                        f"{param}: a final assistant message cannot hold a tool_use block; send the "
                        "tool_result in a user message after it",
                        param,
                    )
        return last.text(where)


class MessagesRequest(PromptFields):
    max_tokens: Annotated[int, Field(ge=1)]
    stop_sequences: (
        Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]],
            Field(max_length=MAX_STOP_SEQUENCES),
        ]
        | None
    ) = None
    stream: bool | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0)] | None = None  # 0 means no top-k filter
    metadata: Metadata | None = None
    container: Any = None
    # Accepted and ignored.
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    diagnostics: dict[str, Any] | None = None

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    def check_supported(self) -> None:
        super().check_supported()
        if self.container is not None:
            raise UnsupportedParameterError("containers are not supported", "container")

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop_sequences or ())

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams fields that the request sets (max_tokens excluded)."""
        constraint = self.constraint()
        values = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "grammar": None if constraint is None else constraint.spec,
        }
        return {name: value for name, value in values.items() if value is not None}


class CountTokensRequest(PromptFields):
    """`POST /v1/messages/count_tokens`: only the fields that decide the prompt."""


def _join_text(blocks: list[TextBlock] | list[ContentBlock], where: str, role: str = "system") -> str:
    """Text blocks joined by newlines; thinking blocks dropped; any other block refused."""
    texts = []
    for number, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif not isinstance(block, ThinkingBlock | RedactedThinkingBlock):
            _refuse(block, f"{where}[{number}]", role)
    return "\n".join(texts)
