"""Anthropic Messages request schemas: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Parsing is strict: wrong types, out-of-range values and unknown fields fail (400 naming the param).
Fields fall in three groups:
- honoured: model, max_tokens, messages (text content; a final assistant message is a prefill),
  system, stop_sequences, stream, temperature, top_p, top_k; metadata.user_id keys the session for
  routing affinity (session.py);
- accepted and ignored: service_tier, cache_control (top level and on text blocks), citations on
  text blocks, inference_geo, speed, diagnostics, user_profile_id, workspace_id, output_config.effort,
  thinking `disabled`, tool_choice `none`, and an empty tools list;
- defined by Anthropic but not honoured here: they parse, then `check_supported` (or turning the
  messages into template messages) rejects them with UnsupportedParameterError: content blocks other
  than text (image, document, tool_use, tool_result, thinking, ...), tools, tool_choice, thinking
  other than disabled, container. output_config.format (json_schema) is honoured: schemas/structured.py.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from services.codec.errors import UnsupportedParameterError
from services.codec.protocols.schemas import structured
from services.codec.text.stop_strings import MAX_STOP_STRING_CHARS
from services.common.errors import InvalidRequestError
from services.common.grammar import Constraint

MAX_STOP_SEQUENCES = 16  # a server limit: each one is matched against every token's text
MAX_USER_ID_LEN = 256

# Block types the API defines that a text-only server cannot take (anthropic 2.14 ContentBlockParam).
UNSUPPORTED_BLOCK_TYPES = Literal[
    "image",
    "document",
    "search_result",
    "thinking",
    "redacted_thinking",
    "tool_use",
    "tool_result",
    "server_tool_use",
    "web_search_tool_result",
    "web_fetch_tool_result",
    "code_execution_tool_result",
    "bash_code_execution_tool_result",
    "text_editor_code_execution_tool_result",
    "tool_search_tool_result",
    "container_upload",
]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class UnsupportedBlock(BaseModel):
    """A block this server cannot serve; it parses only so that the error can name its type."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: UNSUPPORTED_BLOCK_TYPES


def _block_kind(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return "text_block" if kind == "text" else "other_block"


# Tagged by `type`, with tag names that are no field's name, so that error params stay exact.
ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text_block")] | Annotated[UnsupportedBlock, Tag("other_block")],
    Discriminator(_block_kind),
]


class InputMessage(Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def text(self, where: str) -> str:
        """The message's text: a string as is, text blocks joined by newlines."""
        if isinstance(self.content, str):
            return self.content
        return _join_text(self.content, f"{where}.content")


class Metadata(Strict):
    user_id: Annotated[str, Field(max_length=MAX_USER_ID_LEN)] | None = None


class ThinkingConfig(Strict):
    type: Literal["enabled", "disabled", "adaptive", "between_tools"]
    budget_tokens: int | None = None
    display: Literal["summarized", "omitted"] | None = None


class ToolChoice(Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputConfig(Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: structured.AnthropicFormat | None = None


class PromptFields(Strict):
    """What decides the prompt: the whole of a count_tokens request, and part of a messages one."""

    def constraint(self) -> Constraint | None:
        """`output_config.format` (json_schema) as a structured output constraint."""
        text_format = self.output_config.format if self.output_config is not None else None
        return structured.pick((structured.from_anthropic_format(text_format), "output_config.format"))

    model: str
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored.
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def check_supported(self) -> None:
        """Raises for the first field this server cannot honour."""
        if self.tools:
            raise UnsupportedParameterError("tool use is not supported yet", "tools")
        if self.tool_choice is not None and self.tool_choice.type != "none":
            raise UnsupportedParameterError("tool use is not supported yet", "tool_choice")
        if self.thinking is not None and self.thinking.type != "disabled":
            raise UnsupportedParameterError("extended thinking is not supported by this model", "thinking")
        self.constraint()
        prefill = self.prefill_text()
        if prefill is not None and prefill != prefill.rstrip():
            where = f"messages[{len(self.messages) - 1}].content"
            raise InvalidRequestError("final assistant content cannot end with trailing whitespace", where)

    def template_messages(self) -> list[dict[str, Any]]:
        """The conversation for the chat template: `system` first, then every message except a
        final assistant one (the prefill, see `prefill_text`)."""
        rendered: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else _join_text(self.system, "system")
            rendered.append({"role": "system", "content": system})
        history = self.messages[:-1] if self.prefill_text() is not None else self.messages
        for index, message in enumerate(history):
            rendered.append({"role": message.role, "content": message.text(f"messages[{index}]")})
        return rendered

    def prefill_text(self) -> str | None:
        """The final assistant message's text, which the reply continues; None if the last is a user's."""
        last = self.messages[-1]
        if last.role != "assistant":
            return None
        return last.text(f"messages[{len(self.messages) - 1}]")


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


def _join_text(blocks: list[TextBlock] | list[ContentBlock], where: str) -> str:
    texts = []
    for number, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise UnsupportedParameterError(
                f"{block.type} content blocks are not supported by this server", f"{where}[{number}]"
            )
        texts.append(block.text)
    return "\n".join(texts)
