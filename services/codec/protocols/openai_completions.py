"""OpenAI (legacy) Completions: `POST /v1/completions`, non-streamed and streamed.

The prompt is one string or one list of token IDs (a batch of one is unwrapped). Logprobs use the
legacy shape `{tokens, token_logprobs, top_logprobs, text_offset}`. Stream sequence: text chunks
(`object: "text_completion"`, one choice each, `finish_reason: null`), per choice a chunk with empty
text and its finish_reason, the usage chunk (`choices: []`) when stream_options.include_usage, then
`data: [DONE]`. (The SDK's strict mode rejects the null finish_reason that real OpenAI streams carry,
because its type marks the field required; that is an SDK typing limit, not a wire error.)
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from services.codec.admission.tenancy import tenant_of
from services.codec.generation import GenerationStream, SampleFinished, TextDelta, Usage
from services.codec.protocols.common import (
    CollectedSample,
    Envelope,
    admit_and_start,
    collect_unless_gone,
    open_route,
    stream_response,
    usage_body,
)
from services.codec.protocols.schemas.openai import CompletionRequest
from services.codec.protocols.sse import DONE, encode_event
from services.codec.session import SESSION_HEADER, session_key
from services.codec.text.prompts import encode_decoder_prompt, encode_prompt
from services.common.outputs import TokenLogprob

PROTOCOL = "completions"
ID_PREFIX = "cmpl"
OBJECT = "text_completion"

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    state, stats, body = await open_route(request, CompletionRequest, PROTOCOL)
    info = await state.info.get()
    prompt_ids = await encode_prompt(
        body.single_prompt(),
        state.encoder,
        "prompt",
        state.vocab_size,
        empty_text_ok=not info.encoder_decoder,
    )
    decoder_ids = await encode_decoder_prompt(body.decoder_prompt, state.encoder, state.vocab_size)
    generation = await admit_and_start(
        request,
        state,
        stats,
        body,
        prompt_ids,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        prompt_param="prompt",
        # no turns: the header only
        session_key=session_key(
            header=request.headers.get(SESSION_HEADER), tenant=tenant_of(request).tenant_id
        ),
        decoder_prompt_ids=decoder_ids,
    )
    envelope = Envelope.new(ID_PREFIX, OBJECT, state)
    num_samples = body.n or 1
    if body.is_stream:
        events = _chunks(generation, envelope, num_samples, body.include_usage)
        return stream_response(request, stats, generation, events)
    samples, usage = await collect_unless_gone(request, generation, num_samples)
    return JSONResponse(_completion_body(envelope, samples, usage, body.logprobs is not None))


def _completion_body(
    envelope: Envelope, samples: list[CollectedSample], usage: Usage, with_logprobs: bool
) -> dict[str, Any]:
    choices = [
        {
            "index": index,
            "text": sample.text,
            "logprobs": _logprobs(sample.logprobs, 0) if with_logprobs else None,
            "finish_reason": sample.finish.reason.value if sample.finish else "stop",
        }
        for index, sample in enumerate(samples)
    ]
    return envelope.wrap(choices, usage=usage_body(usage))


async def _chunks(
    generation: GenerationStream, envelope: Envelope, num_samples: int, include_usage: bool
) -> AsyncIterator[bytes]:
    offsets = [0] * num_samples  # text_offset continues across chunks of one choice
    async for event in generation:
        if isinstance(event, TextDelta):
            logprobs = _logprobs(event.logprobs, offsets[event.index]) if event.logprobs else None
            offsets[event.index] += sum(len(item.token) for item in event.logprobs)
            yield encode_event(envelope.wrap([_choice(event.index, event.text, logprobs)]))
        elif isinstance(event, SampleFinished):
            yield encode_event(envelope.wrap([_choice(event.index, "", None, event)]))
        elif include_usage:
            yield encode_event(envelope.wrap([], usage=usage_body(event)))
    yield DONE


def _choice(
    index: int, text: str, logprobs: dict[str, Any] | None, finish: SampleFinished | None = None
) -> dict[str, Any]:
    reason = finish.reason.value if finish is not None else None
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}


def _logprobs(logprobs: Sequence[TokenLogprob], first_offset: int) -> dict[str, Any]:
    offsets = []
    offset = first_offset
    for item in logprobs:
        offsets.append(offset)
        offset += len(item.token)
    return {
        "tokens": [item.token for item in logprobs],
        "token_logprobs": [item.logprob for item in logprobs],
        "top_logprobs": [
            {text: logprob for text, (_, logprob) in zip(item.top_tokens, item.top, strict=True)}
            for item in logprobs
        ],
        "text_offset": offsets,
    }
