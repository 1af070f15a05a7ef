"""vLLM-compatible `/tokenize` and `/detokenize` request schemas."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from services.codec.protocols.schemas.openai import ChatMessage, Strict


class TokenizeTextRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    add_generation_prompt: bool = True

    def template_messages(self) -> list[dict[str, object]]:
        call_ids: set[str] = set()
        return [message.to_template(index, call_ids) for index, message in enumerate(self.messages)]


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]
