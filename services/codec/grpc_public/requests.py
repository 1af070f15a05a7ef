"""Public gRPC requests (protos/kvrelay/v1/public.proto) in the terms of the HTTP schemas.

A ChatRequest becomes a ChatCompletionRequest and a TextGenerateRequest a CompletionRequest, built from
only the fields the client set, so both APIs share one set of rules, defaults and error messages (which
name the field, e.g. `messages[0].role` or `temperature`). Only what proto3 cannot say the HTTP way is
checked here: an empty conversation, the prompt given twice or not at all, top_logprobs without logprobs.
"""

from __future__ import annotations

import json
from typing import Any

from services.codec.protocols.request_body import parse_schema
from services.codec.protocols.schemas.openai import ChatCompletionRequest, CompletionRequest
from services.common.errors import InvalidRequestError
from services.common.sampling import MAX_LOGPROBS
from services.proto_gen.kvrelay.v1 import public_pb2 as pb

# SamplingOptions fields with presence (`optional`), copied only when set.
OPTIONAL_SAMPLING_FIELDS = (
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "n",
    "min_tokens",
)


def chat_request(request: pb.ChatRequest, served_model: str) -> ChatCompletionRequest:
    """The request as /v1/chat/completions would parse it; InvalidRequestError names the field."""
    if not request.messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    options = request.sampling
    _check_top_logprobs(options)
    body: dict[str, Any] = {
        "model": request.model or served_model,
        "messages": [_message(message) for message in request.messages],
        **sampling_fields(options),
    }
    if options.logprobs:
        body["logprobs"] = True
    if options.HasField("top_logprobs"):
        body["top_logprobs"] = options.top_logprobs
    body.update(_tool_fields(request))
    if request.HasField("enable_thinking"):
        body["chat_template_kwargs"] = {"enable_thinking": request.enable_thinking}
    return parse_schema(ChatCompletionRequest, body)


def _tool_fields(request: pb.ChatRequest) -> dict[str, Any]:
    """HTTP Chat's `tools`, `tool_choice` and `parallel_tool_calls` for what `request` sets."""
    fields: dict[str, Any] = {}
    if request.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    "description": tool.description or None,
                    "parameters": _json(tool.parameters_json, f"tools[{index}].parameters_json")
                    if tool.parameters_json
                    else None,
                    "strict": tool.strict,
                },
            }
            for index, tool in enumerate(request.tools)
        ]
    if request.HasField("tool_choice"):
        choice = request.tool_choice
        mode = pb.ToolChoice.Mode.Name(choice.mode).lower()
        fields["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}} if mode == "named" else mode
        )
        if choice.disable_parallel:
            fields["parallel_tool_calls"] = False
    return fields


def _json(text: str, param: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError(f"{param} is not JSON", param=param) from None


def completion_request(request: pb.TextGenerateRequest, served_model: str) -> CompletionRequest:
    """The request as /v1/completions would parse it; InvalidRequestError names the field."""
    if bool(request.prompt) == bool(request.prompt_token_ids):
        raise InvalidRequestError("set exactly one of prompt and prompt_token_ids", param="prompt")
    options = request.sampling
    _check_top_logprobs(options)
    prompt: str | list[int] = request.prompt or list(request.prompt_token_ids)
    body: dict[str, Any] = {
        "model": request.model or served_model,
        "prompt": prompt,
        **sampling_fields(options),
    }
    if options.logprobs:
        body["logprobs"] = options.top_logprobs
    if request.HasField("decoder_prompt"):
        body["decoder_prompt"] = request.decoder_prompt
    return parse_schema(CompletionRequest, body)


def sampling_fields(options: pb.SamplingOptions) -> dict[str, Any]:
    """The HTTP fields for what `options` sets; unset fields are left out, so the defaults match."""
    fields: dict[str, Any] = {
        name: getattr(options, name) for name in OPTIONAL_SAMPLING_FIELDS if options.HasField(name)
    }
    if options.stop:
        fields["stop"] = list(options.stop)
    if options.stop_token_ids:
        fields["stop_token_ids"] = list(options.stop_token_ids)
    if options.ignore_eos:
        fields["ignore_eos"] = True
    if options.HasField("structured_output"):
        fields["structured_outputs"] = _structured_output(options.structured_output)
    return fields


def _structured_output(message: pb.StructuredOutput) -> dict[str, Any]:
    """The HTTP `structured_outputs` object for the constraint `message` sets."""
    kind = message.WhichOneof("kind")
    if kind is None:
        raise InvalidRequestError("structured_output sets no constraint", param="sampling.structured_output")
    if kind == "json_schema":
        return {"json": message.json_schema}  # the text: parsed and checked when it is compiled
    if kind == "choice":
        return {"choice": list(message.choice.values)}
    return {kind: getattr(message, kind)}


def _message(message: pb.ChatMessage) -> dict[str, Any]:
    fields: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.name:
        fields["name"] = message.name
    if message.tool_calls:
        fields["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments_json},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        fields["tool_call_id"] = message.tool_call_id
    return fields


def _check_top_logprobs(options: pb.SamplingOptions) -> None:
    """Checked here because /v1/completions names the count `logprobs`."""
    if options.HasField("top_logprobs") and not options.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    if options.top_logprobs > MAX_LOGPROBS:
        raise InvalidRequestError(
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {options.top_logprobs}", "top_logprobs"
        )
