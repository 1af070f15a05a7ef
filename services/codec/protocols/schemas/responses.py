"""OpenAI Responses request schema (`POST /v1/responses`), as defined by openai 3.57.0.

Parsing is strict like the other OpenAI schemas: wrong types, out-of-range values and unknown fields
fail with a 400 naming the param. Fields fall in three groups:
- honoured: `model`, `input`, `instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`,
  `store`, `previous_response_id`, and echoed back: `metadata`, `user`, `safety_identifier`,
  `prompt_cache_key` (which also keys the session for routing, session.py), `parallel_tool_calls`,
  `max_tool_calls`;
- accepted and ignored: `reasoning`, `service_tier`, `stream_options`, `text.verbosity`,
  `prompt_cache_retention`, `prompt_cache_options`, `moderation`, `background_options`;
- defined by OpenAI but not honoured here: they parse, then `check_supported` rejects them with
  UnsupportedParameterError (tools, tool_choice other than none/auto, non-text `text.format`,
  `background: true`, `conversation`, `prompt`, `include` values, `truncation: "auto"`,
  `top_logprobs` > 0, `context_management`, `image`, `access_programs`, image/file/audio parts and
  input items other than messages).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, PrivateAttr, Tag

from services.codec.errors import UnsupportedParameterError
from services.codec.protocols.schemas import structured
from services.codec.protocols.schemas.openai import SamplingFields, Strict
from services.common.errors import InvalidRequestError
from services.common.grammar import Constraint
from services.common.sampling import MAX_LOGPROBS

TEXT_PART_TYPES = {"user": "input_text", "system": "input_text", "developer": "input_text"}
ASSISTANT_PART_TYPES = ("output_text", "refusal")
MEDIA_PART_TYPES = ("input_image", "input_file", "input_audio")
# Input items OpenAI defines besides messages: tool calls, their outputs and reasoning.
OTHER_ITEM_TYPES = Literal[
    "function_call",
    "function_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "reasoning",
    "item_reference",
    "compaction",
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
            raise UnsupportedParameterError(f"{part.type} content is not supported by this model", param)
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


class OtherItem(Strict):
    """A non-message input item: recognised so the error says it is unsupported, then rejected."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: OTHER_ITEM_TYPES


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return "message" if value.get("type", "message") in ("message", None) else "other"
    if isinstance(value, InputMessage | OtherItem):
        return "message" if isinstance(value, InputMessage) else "other"
    return None


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[OtherItem, Tag("other")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_input_item",
        custom_error_message="each input item must be an object (a message or another item type)",
    ),
]


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
    prompt_cache_key: str | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None
    # Accepted and ignored.
    reasoning: dict[str, Any] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    background_options: dict[str, Any] | None = None
    # Defined by OpenAI, rejected by `check_supported` unless absent, empty or neutral.
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
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
        if self.tools:
            raise UnsupportedParameterError("tool calling is not supported yet", "tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise UnsupportedParameterError("tool calling is not supported yet", "tool_choice")
        self.constraint()
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.truncation == "auto":
            raise UnsupportedParameterError("only truncation 'disabled' is supported", "truncation")
        if self.top_logprobs:
            raise UnsupportedParameterError("top_logprobs is not supported yet", "top_logprobs")
        if self.background:
            raise UnsupportedParameterError("background responses are not supported", "background")
        if self.include:
            raise UnsupportedParameterError("include values are not supported", "include")
        for name in ("conversation", "prompt", "context_management", "image", "access_programs"):
            if getattr(self, name):
                raise UnsupportedParameterError(f"{name} is not supported", name)

    def input_messages(self) -> list[dict[str, str]]:
        """`input` as chat-template messages (a string is one user message); `instructions` excluded."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages = []
        for index, item in enumerate(self.input):
            if isinstance(item, OtherItem):
                raise UnsupportedParameterError(
                    f"input items of type {item.type!r} are not supported yet; send messages",
                    f"input[{index}]",
                )
            messages.append(item.to_template(index))
        return messages

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
