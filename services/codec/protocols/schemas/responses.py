"""OpenAI Responses request schema (`POST /v1/responses`), as defined by openai 3.57.0.

Parsing is strict like the other OpenAI schemas: wrong types, out-of-range values and unknown fields
fail with a 400 naming the param. Fields fall in three groups:
- honoured: `model`, `input`, `instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`,
  `store`, `previous_response_id`, `text.format`, function `tools` with `tool_choice` none / auto /
  required / `{"type": "function", "name"}` / `allowed_tools` (a hard limit on the tools a call may
  name) and `parallel_tool_calls` (text/tool_calls.py), `reasoning.effort` on a model with a thinking
  mode (none/minimal: off; low/medium/high: a budget of 1024/4096/16384 tokens; xhigh/max: unbounded),
  `background` (queued, run by a drainer: protocols/openai_responses_background.py; it needs `store`),
  and echoed back: `metadata`, `user`, `safety_identifier`, `prompt_cache_key` (which also keys the
  session for routing, session.py), `max_tool_calls`;
- checked: `service_tier` picks the priority class, `priority` needs a key allowed it
  (protocols/service_tier.py), and the response says the tier that served it;
- accepted and ignored: the rest of `reasoning` (and all of it on a model without a thinking mode),
  `stream_options`, `text.verbosity`, `prompt_cache_retention`, `prompt_cache_options`,
  `moderation`, `background_options`; `reasoning` input items (the model's earlier thinking is not
  replayed, as Qwen3's template drops it too);
- defined by OpenAI but not honoured here: they parse, then `check_supported` rejects them with
  UnsupportedParameterError (tools other than functions, the hosted tools' tool_choice values,
  `conversation`, `prompt`, `include` values, `truncation: "auto"`,
  `top_logprobs` > 0, `context_management`, `image`, `access_programs`, image/file/audio parts and
  input items other than messages, function calls, their outputs, reasoning and compaction).

Input items become chat-template messages (`input_messages`): a message as itself; consecutive
`function_call` items one assistant message with `tool_calls` (their arguments parsed), the assistant
message right before them if there is one (the text the model wrote before calling); a
`function_call_output` a `tool` message, which must answer a call made earlier in `input` or in the
stored conversation of `previous_response_id` (else a 400 naming its `call_id`); a `compaction` item
(openai_responses_compact.py) the summary it seals, at the head of the next user message.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, Tag

from services.codec.errors import UnknownParameterError, UnsupportedParameterError
from services.codec.protocols.schemas import structured
from services.codec.protocols.schemas.openai import (
    MAX_PROMPT_CACHE_KEY_CHARS,
    REASONING_BUDGETS,
    SamplingFields,
    Strict,
)
from services.codec.text.reasoning import Thinking
from services.codec.text.tool_calls import Tool, ToolChoice, ToolChoiceMode, ToolSet
from services.common.errors import InvalidRequestError
from services.common.grammar import Constraint
from services.common.sampling import MAX_LOGPROBS

TEXT_PART_TYPES = {"user": "input_text", "system": "input_text", "developer": "input_text"}
ASSISTANT_PART_TYPES = ("output_text", "refusal")
MEDIA_PART_TYPES = ("input_image", "input_file", "input_audio")
# Input items OpenAI defines besides messages, function calls, their outputs and reasoning.
OTHER_ITEM_TYPES = Literal[
    "custom_tool_call",
    "custom_tool_call_output",
    "item_reference",
    "file_search_call",
    "web_search_call",
    "computer_call",
    "computer_call_output",
    "code_interpreter_call",
    "image_generation_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
]
CallId = Annotated[str, Field(min_length=1, max_length=64)]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class InputPart(Strict):
    """One content part. Only text parts are served; media parts parse so the error can say so."""

    model_config = ConfigDict(extra="allow", strict=True)  # annotations, logprobs, image_url, ...
    type: Literal["input_text", "output_text", "refusal", "input_image", "input_file", "input_audio"]
    text: str | None = None
    refusal: str | None = None


class InputMessage(Strict):
    """A message item; `type` may be omitted (OpenAI's EasyInputMessage)."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    def to_template(self, index: int) -> dict[str, str]:
        """The message as the chat template sees it: `developer` becomes `system`, text parts join."""
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return {"role": role, "content": self.content}
        texts = [self._part_text(f"input[{index}].content[{n}]", part) for n, part in enumerate(self.content)]
        return {"role": role, "content": "\n".join(texts)}

    def _part_text(self, param: str, part: InputPart) -> str:
        if part.type in MEDIA_PART_TYPES:
            raise UnsupportedParameterError(_media_refusal(part.type, "content"), param)
        allowed = ASSISTANT_PART_TYPES if self.role == "assistant" else (TEXT_PART_TYPES[self.role],)
        if part.type not in allowed:
            raise InvalidRequestError(
                f"{param}.type: {part.type!r} is not allowed in a {self.role} message; use {allowed}",
                param=f"{param}.type",
            )
        field = "refusal" if part.type == "refusal" else "text"
        value = getattr(part, field)
        if value is None:
            raise InvalidRequestError(f"{param}.{field} is required", param=f"{param}.{field}")
        return str(value)


class FunctionCallItem(Strict):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: CallId
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None  # accepted and ignored
    caller: dict[str, Any] | None = None  # accepted and ignored

    def to_template_call(self, index: int) -> dict[str, Any]:
        """The call as chat templates take it (OpenAI Chat's shape, its arguments an object)."""
        try:
            arguments = json.loads(self.arguments)
        except ValueError:
            raise InvalidRequestError(
                f"input[{index}].arguments is not JSON", f"input[{index}].arguments"
            ) from None
        return {
            "id": self.call_id,
            "type": "function",
            "function": {"name": self.name, "arguments": arguments},
        }


class FunctionCallOutputItem(Strict):
    """A function's result, answering the call with the same `call_id`."""

    type: Literal["function_call_output"]
    call_id: CallId | None = None  # optional in the SDK's types, required here
    output: str | list[InputPart]
    id: str | None = None
    status: ItemStatus | None = None
    name: str | None = None  # accepted and ignored
    namespace: str | None = None  # accepted and ignored
    caller: dict[str, Any] | None = None  # accepted and ignored

    def to_template(self, index: int, call_ids: set[str]) -> dict[str, Any]:
        where = f"input[{index}]"
        if self.call_id is None:
            raise InvalidRequestError(f"{where}.call_id is required", f"{where}.call_id")
        if self.call_id not in call_ids:
            raise InvalidRequestError(
                f"{where} answers function call {self.call_id!r}, which no function_call item made "
                "(in input or the conversation of previous_response_id)",
                f"{where}.call_id",
            )
        return {"role": "tool", "tool_call_id": self.call_id, "content": self._text(where)}

    def _text(self, where: str) -> str:
        if isinstance(self.output, str):
            return self.output
        texts = []
        for number, part in enumerate(self.output):
            param = f"{where}.output[{number}]"
            if part.type in MEDIA_PART_TYPES:
                raise UnsupportedParameterError(_media_refusal(part.type, "output"), param)
            if part.type != "input_text":
                raise InvalidRequestError(
                    f"{param}.type: {part.type!r} is not allowed in a function_call_output; use input_text",
                    f"{param}.type",
                )
            if part.text is None:
                raise InvalidRequestError(f"{param}.text is required", f"{param}.text")
            texts.append(part.text)
        return "\n".join(texts)


class ReasoningItem(Strict):
    """The model's earlier thinking, sent back: accepted and dropped."""

    model_config = ConfigDict(extra="allow", strict=True)  # id, summary, content, encrypted_content, ...
    type: Literal["reasoning"]


class CompactionItem(Strict):
    """The window `/v1/responses/compact` returned: a summary only this server can open."""

    type: Literal["compaction"]
    encrypted_content: Annotated[str, Field(min_length=1, max_length=10 * 1024 * 1024)]
    id: str | None = None
    created_by: str | None = None  # accepted and ignored


SUMMARY_HEADING = "Summary of the conversation so far:"
OpenCompaction = Callable[[str, str], str]  # (encrypted_content, param) -> the summary, or a 400


class OtherItem(Strict):
    """Another input item: recognised so the error says it is unsupported, then rejected."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: OTHER_ITEM_TYPES


# Tags are never field names (`_param` in request_body.py would keep them in the 400's param).
_ITEM_TAGS = {
    "message": "message",
    None: "message",
    "function_call": "call_item",
    "function_call_output": "call_output_item",
    "reasoning": "reasoning_item",
    "compaction": "compaction_item",
}
_ITEM_CLASS_TAGS: tuple[tuple[type[Strict], str], ...] = (
    (InputMessage, "message"),
    (FunctionCallItem, "call_item"),
    (FunctionCallOutputItem, "call_output_item"),
    (ReasoningItem, "reasoning_item"),
    (CompactionItem, "compaction_item"),
    (OtherItem, "other"),
)


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return _ITEM_TAGS.get(kind, "other") if isinstance(kind, str | None) else "other"
    return next((tag for cls, tag in _ITEM_CLASS_TAGS if isinstance(value, cls)), None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("call_item")]
    | Annotated[FunctionCallOutputItem, Tag("call_output_item")]
    | Annotated[ReasoningItem, Tag("reasoning_item")]
    | Annotated[CompactionItem, Tag("compaction_item")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_input_item",
        custom_error_message="each input item must be an object (a message or another item type)",
    ),
]


class FunctionToolParam(Strict):
    """A function tool (flat, unlike Chat's): its parameters' schema must describe an object."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    # Accepted and ignored.
    defer_loading: bool | None = None

    def to_tool(self) -> Tool:
        parameters = self.parameters if self.parameters is not None else {"type": "object"}
        return Tool(self.name, parameters, self.description, bool(self.strict))

    def echo(self) -> dict[str, Any]:
        """The tool as the response object lists it."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": bool(self.strict),
        }


class OtherTool(Strict):
    """A hosted or custom tool: recognised so the error says it is unsupported."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def _tool_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return "function" if value.get("type") == "function" else "other_tool"
    if isinstance(value, FunctionToolParam | OtherTool):
        return "function" if isinstance(value, FunctionToolParam) else "other_tool"
    return None


ToolParam = Annotated[
    Annotated[FunctionToolParam, Tag("function")] | Annotated[OtherTool, Tag("other_tool")],
    Discriminator(
        _tool_kind,
        custom_error_type="invalid_tool",
        custom_error_message="each tool must be an object with a type",
    ),
]


class FunctionToolChoice(Strict):
    type: Literal["function"]
    name: str


class ReasoningConfig(Strict):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # Accepted and ignored.
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class TextConfig(Strict):
    format: structured.TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted and ignored


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None  # accepted and ignored


class ResponsesRequest(Strict):
    model: str
    input: Annotated[str, Field(min_length=1)] | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    store: bool | None = None
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=16)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: Annotated[str, Field(max_length=MAX_PROMPT_CACHE_KEY_CHARS)] | None = None
    # Checked (protocols/cache_retention.py): "24h" needs a key with that permission.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    # Accepted and ignored.
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    # Defined by OpenAI, rejected by `check_supported` unless absent, empty or neutral.
    text: TextConfig | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    include: list[str] | None = None
    prompt: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    context_management: list[dict[str, Any]] | None = None
    image: dict[str, Any] | None = None
    access_programs: list[dict[str, Any]] | None = None

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def is_stored(self) -> bool:
        """OpenAI stores responses unless told not to."""
        return self.store is not False

    def check_supported(self) -> None:
        """Raises for the first field this server cannot honour."""
        self.toolset()
        self.constraint()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.truncation == "auto":
            raise UnsupportedParameterError("only truncation 'disabled' is supported", "truncation")
        if self.top_logprobs:
            raise UnsupportedParameterError("top_logprobs is not supported yet", "top_logprobs")
        if self.background and not self.is_stored:
            raise InvalidRequestError("background responses must be stored: drop store: false", "background")
        if self.include:
            raise UnsupportedParameterError("include values are not supported", "include")
        for name in ("conversation", "prompt", "context_management", "image", "access_programs"):
            if getattr(self, name):
                raise UnsupportedParameterError(f"{name} is not supported", name)

    def input_messages(
        self, earlier_call_ids: Iterable[str] = (), open_compaction: OpenCompaction | None = None
    ) -> list[dict[str, Any]]:
        """`input` as chat-template messages (a string is one user message); `instructions` excluded.
        `earlier_call_ids`: the calls of the stored conversation this input continues, which a
        function_call_output may answer besides the function_call items of `input` itself.
        `open_compaction` opens a `compaction` item into its summary, which becomes the start of the
        next user message (its own user message when none follows at once), so templates that insist
        on alternating turns (Gemma's) still take it."""
        return _with_summaries(self._input_messages(earlier_call_ids, open_compaction))

    def _input_messages(
        self, earlier_call_ids: Iterable[str], open_compaction: OpenCompaction | None
    ) -> list[dict[str, Any]]:
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        call_ids = set(earlier_call_ids)
        messages: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] | None = None  # the open assistant message's calls
        for index, item in enumerate(self.input):
            if isinstance(item, CompactionItem):
                if open_compaction is None:
                    raise UnsupportedParameterError(
                        "compaction items are not accepted here", f"input[{index}]"
                    )
                summary = open_compaction(item.encrypted_content, f"input[{index}].encrypted_content")
                messages.append({"role": "user", "content": f"{SUMMARY_HEADING}\n{summary}", _SUMMARY: True})
                calls = None
                continue
            if isinstance(item, OtherItem):
                raise UnsupportedParameterError(
                    f"input items of type {item.type!r} are not supported; send messages and function calls",
                    f"input[{index}]",
                )
            if isinstance(item, ReasoningItem):
                continue
            if isinstance(item, FunctionCallItem):
                if calls is None and messages and _is_plain_assistant(messages[-1]):
                    calls = messages[-1]["tool_calls"] = []  # the text the model wrote before its calls
                elif calls is None:
                    calls = []
                    messages.append({"role": "assistant", "content": "", "tool_calls": calls})
                calls.append(item.to_template_call(index))
                call_ids.add(item.call_id)
                continue
            calls = None
            if isinstance(item, FunctionCallOutputItem):
                messages.append(item.to_template(index, call_ids))
            else:
                messages.append(item.to_template(index))
        return messages

    def toolset(self) -> ToolSet | None:
        """The offered function tools and the choice; a 400 for a tool or a choice that cannot be honoured."""
        if not self.tools and self.tool_choice in (None, "none", "auto"):
            return None
        tools = []
        for tool in self.tools or ():
            if isinstance(tool, OtherTool):
                raise UnsupportedParameterError(f"tools of type {tool.type!r} are not supported", "tools")
            tools.append(tool.to_tool())
        return ToolSet(tuple(tools), self._tool_choice(), "tools", "tool_choice")

    def _tool_choice(self) -> ToolChoice:
        parallel = self.parallel_tool_calls is not False
        choice = self.tool_choice
        if choice is None:
            return ToolChoice(ToolChoiceMode.AUTO, parallel=parallel)
        if isinstance(choice, str):
            return ToolChoice(ToolChoiceMode(choice), parallel=parallel)
        if choice.get("type") == "allowed_tools":
            mode, allowed = parse_allowed_tools(choice)
            return ToolChoice(mode, parallel=parallel, allowed=allowed)
        if choice.get("type") != "function":
            kind = choice.get("type")
            raise UnsupportedParameterError(
                f"tool_choice of type {kind!r} is not supported; use none, auto, required, a function "
                "or allowed_tools",
                "tool_choice",
            )
        named = parse_function_choice(choice)
        return ToolChoice(ToolChoiceMode.NAMED, named.name, parallel=parallel)

    def thinking(self) -> Thinking | None:
        """`reasoning.effort` on a model with a thinking mode: none/minimal off, else on with its budget."""
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort is None:
            return None
        if effort in ("none", "minimal"):
            return Thinking(False)
        return Thinking(True, REASONING_BUDGETS.get(effort))

    def reasoning_body(self) -> dict[str, Any] | None:
        """The response object's `reasoning` (when honoured): the effort asked for."""
        if self.reasoning is None:
            return None
        return {"effort": self.reasoning.effort, "summary": self.reasoning.summary}

    def tools_body(self) -> list[dict[str, Any]]:
        """The response object's `tools`: the function tools offered."""
        return [tool.echo() for tool in self.tools or () if isinstance(tool, FunctionToolParam)]

    def constraint(self) -> Constraint | None:
        """`text.format` json_schema or json_object, as a structured output constraint."""
        text_format = self.text.format if self.text is not None else None
        return structured.pick((structured.from_text_format(text_format), "text.format"))

    def text_body(self) -> dict[str, Any]:
        """The response object's `text`: the format asked for, echoed (text when none was)."""
        text_format = self.text.format if self.text is not None else None
        if text_format is None:
            return {"format": {"type": "text"}}
        return {"format": text_format.model_dump(by_alias=True, exclude_none=True)}

    def sampling_fields(self) -> SamplingFields:
        """The sampling knobs in the shape the shared OpenAI admission takes."""
        fields = _ResponsesSampling(model=self.model, temperature=self.temperature, top_p=self.top_p)
        fields._text_constraint = self.constraint()
        return fields


class _ResponsesSampling(SamplingFields):
    """SamplingFields whose constraint is the Responses request's `text.format`."""

    _text_constraint: Constraint | None = PrivateAttr(default=None)

    def constraint(self) -> Constraint | None:
        return self._text_constraint


def parse_function_choice(choice: Mapping[str, Any]) -> FunctionToolChoice:
    """`{"type": "function", "name": ...}`: a 400 at tool_choice for anything else."""
    unknown = sorted(set(choice) - {"type", "name"})
    if unknown:
        raise UnknownParameterError(
            f"unrecognized request argument supplied: tool_choice.{unknown[0]}", f"tool_choice.{unknown[0]}"
        )
    name = choice.get("name")
    if not isinstance(name, str):
        raise InvalidRequestError("tool_choice.name: a function's name is required", "tool_choice.name")
    return FunctionToolChoice(type="function", name=name)


def parse_allowed_tools(choice: Mapping[str, Any]) -> tuple[ToolChoiceMode, tuple[str, ...]]:
    """`{"type": "allowed_tools", "mode": "auto" | "required", "tools": [{"type": "function", "name"}]}`:
    its mode and the names of the function tools a call may name."""
    unknown = sorted(set(choice) - {"type", "mode", "tools"})
    if unknown:
        param = f"tool_choice.{unknown[0]}"
        raise UnknownParameterError(f"unrecognized request argument supplied: {param}", param)
    mode = choice.get("mode")
    if mode not in ("auto", "required"):
        raise InvalidRequestError("tool_choice.mode must be auto or required", "tool_choice.mode")
    tools = choice.get("tools")
    if not isinstance(tools, list):
        raise InvalidRequestError("tool_choice.tools must be a list of tools", "tool_choice.tools")
    names = []
    for index, tool in enumerate(tools):
        param = f"tool_choice.tools[{index}]"
        if not isinstance(tool, Mapping) or not isinstance(tool.get("type"), str):
            raise InvalidRequestError(f"{param} must be a tool with a type", param)
        if tool["type"] != "function":
            raise UnsupportedParameterError(
                f"allowed tools of type {tool['type']!r} are not supported", param
            )
        if set(tool) - {"type", "name"} or not isinstance(tool.get("name"), str):
            raise InvalidRequestError(f'{param} must be {{"type": "function", "name": ...}}', param)
        names.append(tool["name"])
    return ToolChoiceMode(mode), tuple(names)


_SUMMARY = "kvrelay_summary"  # marks an opened compaction item until _with_summaries places it


def _with_summaries(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each opened compaction summary joined to the user message right after it (else left alone)."""
    out: list[dict[str, Any]] = []
    after_summary = False
    for message in messages:
        is_summary = bool(message.get(_SUMMARY))
        message = {key: value for key, value in message.items() if key != _SUMMARY}
        if after_summary and message["role"] == "user" and isinstance(message.get("content"), str):
            out[-1] = {"role": "user", "content": f"{out[-1]['content']}\n\n{message['content']}"}
        else:
            out.append(message)
        after_summary = is_summary
    return out


def _media_refusal(part_type: str, where: str) -> str:
    """A media part on this text-only server: the error names the capability the model lacks."""
    capability = {"input_image": "image input (vision)", "input_audio": "audio input"}.get(
        part_type, "file input"
    )
    return f"this model is text-only and has no {capability}: {part_type} {where} is not supported"


def call_ids_of(messages: Iterable[Mapping[str, Any]]) -> set[str]:
    """The IDs of the calls made in chat-template `messages` (a stored conversation)."""
    return {
        str(call.get("id"))
        for message in messages
        for call in message.get("tool_calls") or ()
        if isinstance(call, Mapping)
    }


def _is_plain_assistant(message: Mapping[str, Any]) -> bool:
    return message.get("role") == "assistant" and "tool_calls" not in message
