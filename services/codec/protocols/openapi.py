"""`GET /openapi.json`: an OpenAPI 3.1 document of the codec's generation routes, built from the request
models the routes parse bodies with (protocols/schemas/), so it cannot drift from what is accepted.

The routes read their bodies themselves (protocols/request_body.py) rather than through FastAPI's
parameters, so FastAPI's own generated document would be empty; this one names each route, its request
schema and the statuses it answers. It is what the fuzz run reads (tests/e2e/test_fuzz_api.py,
scripts/fuzz_api.py: schemathesis generates requests from it). Behind the API key like every route.
"""

from __future__ import annotations

import functools
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.codec.protocols.schemas.anthropic import CountTokensRequest, MessagesRequest
from services.codec.protocols.schemas.openai import ChatCompletionRequest, CompletionRequest
from services.codec.protocols.schemas.responses import ResponsesRequest
from services.codec.protocols.schemas.tokenize import TokenizeTextRequest
from services.codec.state import codec_state

router = APIRouter()

OPERATIONS: tuple[tuple[str, str, type[BaseModel]], ...] = (
    ("/v1/chat/completions", "createChatCompletion", ChatCompletionRequest),
    ("/v1/completions", "createCompletion", CompletionRequest),
    ("/v1/responses", "createResponse", ResponsesRequest),
    ("/v1/messages", "createMessage", MessagesRequest),
    ("/v1/messages/count_tokens", "countMessageTokens", CountTokensRequest),
    ("/tokenize", "tokenize", TokenizeTextRequest),
)
# What a route may answer: its result, or an error in its protocol's shape.
STATUSES = {
    "200": "the result (JSON, or server-sent events when streamed)",
    "400": "an invalid request", "401": "no valid API key", "404": "an unknown model or object",
    "413": "a body over limits.max_body_bytes", "415": "a body that is not JSON",
    "429": "a quota or the admission queue", "503": "the pools or a store are unavailable",
    "529": "overloaded (Anthropic's routes)",
}  # fmt: skip


@functools.cache
def document(version: str, served_model: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document, its request schemas as pydantic validates bodies; `model` names the one
    model this stack serves (any other is a 404)."""
    _, schemas = models_json_schema(
        [(model, "validation") for _, _, model in OPERATIONS], ref_template="#/components/schemas/{model}"
    )
    for _, _, model in OPERATIONS:
        served = schemas["$defs"][model.__name__].get("properties", {}).get("model")
        if served is not None:
            served.clear()
            served.update({"type": "string", "enum": [served_model]})
    responses = {status: {"description": meaning} for status, meaning in STATUSES.items()}
    paths = {
        path: {
            "post": {
                "operationId": operation,
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
                    },
                },
                "responses": responses,
            }
        }
        for path, operation, model in OPERATIONS
    }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvrelay codec", "version": version},
        "paths": paths,
        "components": {
            "schemas": schemas.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }


@router.get("/openapi.json")
async def openapi(request: Request) -> Response:
    return JSONResponse(document(request.app.version, codec_state(request).identity.model_name))
