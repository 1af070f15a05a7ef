"""OpenAI request schemas: Chat Completions and (legacy) Completions.

Parsing is strict: wrong types, out-of-range values and unknown fields fail (400 naming the param).
Fields fall in three groups:
- honoured: sampling knobs, stop, stream, logprobs, seed, n, and vLLM's `ignore_eos`, `top_k`,
  `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`; `prompt_cache_key` (at most 64
  characters) keys the session for routing affinity (session.py), never the cache;
- checked: `prompt_cache_retention` is `in_memory` or `24h`, and `24h` needs a key allowed it
  (protocols/cache_retention.py); both keep the tiers' default lifetime for now;
- checked: `service_tier` picks the priority class, `priority` needs a key allowed it
  (protocols/service_tier.py);
- accepted and ignored: `user`, `metadata`, `store`,
  `prompt_cache_options`, `safety_identifier`, `reasoning_effort`, `verbosity`,
  `parallel_tool_calls`, `moderation`;
- defined by OpenAI but not honoured here: they parse, then `check_supported` rejects them with
  UnsupportedParameterError (audio, prediction, web_search_options, functions, tools, non-text
  response formats, logit_bias, image/audio/file content parts, tool messages, echo, suffix, ...).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.codec.errors import UnsupportedParameterError
from services.codec.protocols.schemas import structured
from services.codec.protocols.schemas.structured import StructuredOutputs
from services.codec.text.reasoning import Thinking
from services.codec.text.stop_strings import MAX_STOP_STRING_CHARS
from services.codec.text.tool_calls import Tool, ToolChoice, ToolChoiceMode, ToolSet
from services.common.errors import InvalidRequestError
from services.common.grammar import Constraint
from services.common.sampling import MAX_LOGPROBS, MAX_N, MAX_STOP_TOKEN_IDS

# `reasoning_effort` as a thinking budget in tokens, on a model with a thinking mode (none/minimal: off).
REASONING_BUDGETS = {"low": 1024, "medium": 4096, "high": 16384}

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
MAX_PROMPT_CACHE_KEY_CHARS = 64  # a key longer than this is a 400 (it keys routing affinity only)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted and ignored


class ContentPart(Strict):
    """One part of a message's content. Only `text` parts are served; the others parse so that
    the error can say what is unsupported."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: str | None = None
    refusal: str | None = None


class FunctionCall(Strict):
    name: str
    arguments: str


class ToolCall(Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None

    def to_template(self, index: int, call_ids: set[str]) -> dict[str, Any]:
        """The message as the chat template sees it: `developer` becomes `system`, text parts join, an
        assistant's calls keep their arguments as objects. `call_ids`: the calls made so far (a tool
        message must answer one of them)."""
        where = f"messages[{index}]"
        for name in ("function_call", "audio"):
            if getattr(self, name):
                raise UnsupportedParameterError(f"{where}.{name} is not supported", f"{where}.{name}")
        if self.role == "tool":
            if self.tool_call_id not in call_ids:
                raise InvalidRequestError(
                    f"{where} answers tool call {self.tool_call_id!r}, which no assistant message made",
                    f"{where}.tool_call_id",
                )
            return {"role": "tool", "content": self._text(where), "tool_call_id": self.tool_call_id}
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role}
        if self.role == "assistant" and self.tool_calls:
            message["content"] = self._text(where) if self.content is not None else ""
            message["tool_calls"] = [
                _template_call(call, f"{where}.tool_calls[{n}]") for n, call in enumerate(self.tool_calls)
            ]
            call_ids.update(call.id for call in self.tool_calls)
        else:
            message["content"] = self._text(where)
        if self.name is not None:
            message["name"] = self.name
        return message

    def _text(self, where: str) -> str:
        if self.content is None:
            raise InvalidRequestError(f"{where}.content is required", param=f"{where}.content")
        if isinstance(self.content, str):
            return self.content
        texts = []
        for number, part in enumerate(self.content):
            param = f"{where}.content[{number}]"
            if part.type != "text":
                raise UnsupportedParameterError(f"{part.type} content is not supported by this model", param)
            if part.text is None:
                raise InvalidRequestError(f"{param}.text is required", param=f"{param}.text")
            texts.append(part.text)
        return "\n".join(texts)


def _template_call(call: ToolCall, where: str) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise InvalidRequestError(
            f"{where}.function.arguments is not JSON", f"{where}.function.arguments"
        ) from None
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


def _allowed_name(tool: dict[str, Any]) -> str:
    """An allowed_tools entry's tool name: `{"type": "function", "function": {"name"}}` (Chat's shape) or
    `{"type": "function", "name"}` (Responses')."""
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    if tool.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequestError("allowed_tools.tools holds function tools by name", "tool_choice")
    return name


class AllowedTools(Strict):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class AllowedToolsChoice(Strict):
    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class SamplingFields(Strict):
    """Fields the two OpenAI text APIs share."""

    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    seed: int | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=4)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions we honour.
    ignore_eos: bool | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    stop_token_ids: (
        Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None
    ) = None
    # vLLM's structured output extras (schemas/structured.py).
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool | None = None  # vLLM's; refused when true (`_check_shared`)

    @property
    def is_stream(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams fields that the request sets (max_tokens and logprobs excluded)."""
        values: dict[str, Any] = {
            "n": self.n,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": None if self.top_k is None else max(self.top_k, 0),  # vLLM's -1 means off
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "seed": self.seed,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": None
            if self.stop_token_ids is None
            else tuple(dict.fromkeys(self.stop_token_ids)),
            "grammar": None if (constraint := self.constraint()) is None else constraint.spec,
        }
        return {name: value for name, value in values.items() if value is not None}

    def constraint(self) -> Constraint | None:
        """The structured output constraint the request names, if any (a 400 when it names several)."""
        return structured.from_vllm(
            self.structured_outputs,
            self.guided_json,
            self.guided_regex,
            self.guided_choice,
            self.guided_grammar,
        )

    def _check_shared(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")
        if self.logit_bias:
            raise UnsupportedParameterError("logit_bias is not supported", "logit_bias")
        if self.use_beam_search:
            raise UnsupportedParameterError(
                "beam search is not supported: kvrelay samples (greedy with temperature 0)", "use_beam_search"
            )


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # Keys the session for routing (session.py), scoped by tenant; not the cache.
    prompt_cache_key: Annotated[str, Field(max_length=MAX_PROMPT_CACHE_KEY_CHARS)] | None = None
    # Checked (protocols/cache_retention.py): "24h" needs a key with that permission.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # The priority class (protocols/service_tier.py): "priority" needs a key with that permission.
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    # Accepted and ignored.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    parallel_tool_calls: bool | None = None
    moderation: dict[str, Any] | None = None
    # Defined by OpenAI, rejected by `check_supported` unless empty or neutral.
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    functions: Any = None
    function_call: Any = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    response_format: structured.ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's; `enable_thinking` is honoured

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_tokens` and `max_completion_tokens` are aliases; given both, the smaller wins."""
        given = [value for value in (self.max_tokens, self.max_completion_tokens) if value is not None]
        return min(given) if given else None

    @property
    def num_top_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None when logprobs are off, else the number of alternatives."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        """Raises for the first field this server cannot honour."""
        self._check_shared()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
        self.toolset()
        if self.functions is not None or self.function_call is not None:
            name = "functions" if self.functions is not None else "function_call"
            raise UnsupportedParameterError("function calling is not supported", name)
        if self.audio is not None or "audio" in (self.modalities or []):
            raise UnsupportedParameterError(
                "audio output is not supported", "audio" if self.audio else "modalities"
            )
        for name in ("prediction", "web_search_options"):
            if getattr(self, name) is not None:
                raise UnsupportedParameterError(f"{name} is not supported", name)
        self.constraint()  # several constraints named: a 400 now, before the prompt is rendered

    def constraint(self) -> Constraint | None:
        return structured.pick(
            (structured.from_response_format(self.response_format), "response_format"), super().constraint()
        )

    def template_messages(self) -> list[dict[str, Any]]:
        call_ids: set[str] = set()
        return [message.to_template(index, call_ids) for index, message in enumerate(self.messages)]

    def toolset(self) -> ToolSet | None:
        """The offered tools and the choice; a 400 for a tool or a choice that cannot be honoured."""
        if not self.tools and self.tool_choice in (None, "none", "auto"):
            return None
        tools = tuple(
            Tool(
                tool.function.name,
                tool.function.parameters if tool.function.parameters is not None else {"type": "object"},
                tool.function.description,
                bool(tool.function.strict),
            )
            for tool in self.tools or ()
        )
        return ToolSet(tools, self._tool_choice(tools), "tools", "tool_choice")

    def _tool_choice(self, tools: tuple[Tool, ...]) -> ToolChoice:
        parallel = self.parallel_tool_calls is not False
        choice = self.tool_choice
        if choice is None:
            return ToolChoice(ToolChoiceMode.AUTO, parallel=parallel)
        if isinstance(choice, str):
            return ToolChoice(ToolChoiceMode(choice), parallel=parallel)
        if isinstance(choice, NamedToolChoice):
            return ToolChoice(ToolChoiceMode.NAMED, choice.function.name, parallel=parallel)
        allowed = tuple(_allowed_name(tool) for tool in choice.allowed_tools.tools)
        return ToolChoice(ToolChoiceMode(choice.allowed_tools.mode), parallel=parallel, allowed=allowed)

    def thinking(self) -> Thinking | None:
        """`chat_template_kwargs.enable_thinking` (vLLM) and `reasoning_effort` (its budget)."""
        kwargs = self.chat_template_kwargs or {}
        enabled = kwargs.get("enable_thinking")
        if self.reasoning_effort in ("none", "minimal"):
            enabled = False
        budget = REASONING_BUDGETS.get(self.reasoning_effort or "")
        if enabled is None and budget is None:
            return None
        return Thinking(enabled is not False, budget)


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    # kvrelay's: an encoder-decoder model's decoder starts from its start token, then this (the prompt is
    # the encoder's input); a decoder-only model refuses it.
    decoder_prompt: str | list[Annotated[int, Field(ge=0)]] | None = None

    def check_supported(self) -> None:
        self._check_shared()
        if self.echo:
            raise UnsupportedParameterError("echo is not supported", "echo")
        if self.suffix is not None:
            raise UnsupportedParameterError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise UnsupportedParameterError(
                "best_of must equal n (or be omitted): kvrelay samples, it does not rank or beam-search",
                "best_of",
            )
        self.single_prompt()

    def single_prompt(self) -> str | list[int]:
        """The one prompt: a string or token IDs. A batch of one is unwrapped; larger batches fail."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        token_ids = [item for item in prompt if isinstance(item, int)]
        if len(token_ids) == len(prompt):
            return token_ids
        if len(prompt) != 1:
            raise UnsupportedParameterError("arrays of prompts are not supported; send one prompt", "prompt")
        only: object = prompt[0]
        if isinstance(only, list):
            return [item for item in only if isinstance(item, int)]
        return str(only)
