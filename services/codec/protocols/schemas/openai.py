"""OpenAI request schemas: Chat Completions and (legacy) Completions.

Parsing is strict: wrong types, out-of-range values and unknown fields fail (400 naming the param).
Fields fall in three groups:
- honoured: sampling knobs, stop, stream, logprobs, seed, n, and vLLM's `ignore_eos`, `top_k`,
  `min_p`, `repetition_penalty`, `min_tokens`, `stop_token_ids`; `prompt_cache_key` keys the session
  for routing affinity (session.py), never the cache;
- accepted and ignored: `user`, `metadata`, `store`, `service_tier`, `prompt_cache_retention`,
  `prompt_cache_options`, `safety_identifier`, `reasoning_effort`, `verbosity`,
  `parallel_tool_calls`, `moderation`;
- defined by OpenAI but not honoured here: they parse, then `check_supported` rejects them with
  UnsupportedParameterError (audio, prediction, web_search_options, functions, tools, non-text
  response formats, logit_bias, image/audio/file content parts, tool messages, echo, suffix, ...).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.codec.errors import UnsupportedParameterError
from services.codec.protocols.schemas import structured
from services.codec.protocols.schemas.structured import StructuredOutputs
from services.codec.text.stop_strings import MAX_STOP_STRING_CHARS
from services.common.errors import InvalidRequestError
from services.common.grammar import Constraint
from services.common.sampling import MAX_LOGPROBS, MAX_N, MAX_STOP_TOKEN_IDS

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


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


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None

    def to_template(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: `developer` becomes `system`, text parts join."""
        where = f"messages[{index}]"
        if self.role == "tool" or self.tool_call_id is not None:
            raise UnsupportedParameterError(
                "tool messages need tool calling, which is not supported yet", where
            )
        for name in ("tool_calls", "function_call", "audio"):
            if getattr(self, name):
                raise UnsupportedParameterError(f"{where}.{name} is not supported yet", f"{where}.{name}")
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self._text(where),
        }
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


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    prompt_cache_key: str | None = None  # keys the session for routing (session.py), not the cache
    # Accepted and ignored.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_retention: str | None = None
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
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: structured.ResponseFormat | None = None

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
        if self.tools:
            raise UnsupportedParameterError("tool calling is not supported yet", "tools")
        if self.tool_choice is not None and self.tool_choice != "none":
            raise UnsupportedParameterError("tool calling is not supported yet", "tool_choice")
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
        return [message.to_template(index) for index, message in enumerate(self.messages)]


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_N)] | None = None

    def check_supported(self) -> None:
        self._check_shared()
        if self.echo:
            raise UnsupportedParameterError("echo is not supported", "echo")
        if self.suffix is not None:
            raise UnsupportedParameterError("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise UnsupportedParameterError("best_of must equal n (or be omitted)", "best_of")
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
