"""Model listing, vLLM-compatible tokenize/detokenize, and Prometheus metrics.

GET  /v1/models, /v1/models/{model}   the one served model
POST /tokenize     {model?, prompt, add_special_tokens?} or {model?, messages, add_generation_prompt?}
                   → {count, max_model_len, tokens}; the IDs a request with that input would use
POST /detokenize   {model?, tokens} → {prompt}
                   Both need a key (as every route but probes and scrapes) and count as a request
                   against the tenant's and the global requests per minute (a 429 past them).
GET  /metrics      this app's registry
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.codec.admission.tenancy import tenant_of
from services.codec.backend.protocol import BackendUnavailableError
from services.codec.protocols.request_body import parse_schema, read_json_object
from services.codec.protocols.schemas.tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeTextRequest,
)
from services.codec.state import CodecState, codec_state
from services.codec.text.prompts import check_token_ids

OWNER = "kvrelay"

router = APIRouter()


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_card(codec_state(request))]})


@router.get("/v1/models/{model:path}")
async def retrieve_model(request: Request, model: str) -> JSONResponse:
    state = codec_state(request)
    state.check_model(model)
    return JSONResponse(_model_card(state))


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = codec_state(request)
    await state.gate.charge_request(tenant_of(request).tenant_id)
    data = await read_json_object(request)
    if "messages" in data:
        chat = parse_schema(TokenizeChatRequest, data)
        state.check_model(chat.model)
        messages = chat.template_messages()
        # a history with tool calls or results renders as chat requests render it (text/assistant.py)
        template = state.assistant.template_for(None, messages) or state.require_chat_template()
        token_ids = await state.encoder.chat(
            template, messages, add_generation_prompt=chat.add_generation_prompt
        )
    else:
        text = parse_schema(TokenizeTextRequest, data)
        state.check_model(text.model)
        token_ids = await state.encoder.text(text.prompt, add_special_tokens=text.add_special_tokens)
    max_model_len = await _max_model_len(state)
    return JSONResponse({"count": len(token_ids), "max_model_len": max_model_len, "tokens": token_ids})


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = codec_state(request)
    await state.gate.charge_request(tenant_of(request).tenant_id)
    body = parse_schema(DetokenizeRequest, await read_json_object(request))
    state.check_model(body.model)
    token_ids = check_token_ids(body.tokens, state.tokenizer.vocab_size, "tokens")
    with state.metrics.time_stage("detokenize"):
        text = state.tokenizer.decode(token_ids, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = codec_state(request)
    if state.config.server.metrics_port is not None:  # served on its own port (server.py)
        raise StarletteHTTPException(404, "Not Found")
    body, content_type = state.metrics.render()
    return Response(body, media_type=content_type)


def _model_card(state: CodecState) -> dict[str, Any]:
    return {
        "id": state.identity.model_name,
        "object": "model",
        "created": state.started_at,
        "owned_by": OWNER,
    }


async def _max_model_len(state: CodecState) -> int | None:
    """The model's context, or None while the backend has never answered (tokenizing still works)."""
    try:
        return (await state.info.get()).max_model_len
    except BackendUnavailableError:
        return None
