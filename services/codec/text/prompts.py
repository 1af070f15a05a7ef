"""Prompts to token IDs: chat messages through the template, raw text, or IDs checked against the vocabulary.

Shared by the protocol routes and /tokenize, so a /tokenize count is exactly what a request would use.
Template and tokenizer time are recorded per stage by the caller's `StageTimer` (the codec's metrics).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

from services.codec.text.chat_template import ChatTemplate
from services.codec.text.tokenizer import Tokenizer
from services.common.errors import InvalidRequestError


class StageTimer(Protocol):
    def time_stage(self, stage: str) -> AbstractContextManager[None]:
        """Times (and traces) one run of the stage named `stage`."""
        ...


def encode_chat(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    metrics: StageTimer,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The template writes the special tokens, so the text is encoded without adding any."""
    with metrics.time_stage("template"):
        text = template.render(messages, add_generation_prompt=add_generation_prompt)
    with metrics.time_stage("tokenize"):
        return tokenizer.encode(text, add_special_tokens=False)


def encode_text(
    tokenizer: Tokenizer, text: str, metrics: StageTimer, *, add_special_tokens: bool = True
) -> list[int]:
    with metrics.time_stage("tokenize"):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_token_ids(token_ids: Sequence[int], vocab_size: int, param: str) -> list[int]:
    """`token_ids` as a list, or a 400 naming `param` for the first ID outside [0, vocab_size)."""
    for position, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"token ID {token_id} at position {position} is outside the vocabulary [0, {vocab_size})",
                param=param,
            )
    return list(token_ids)


def require_tokens(token_ids: list[int], param: str) -> list[int]:
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", param=param)
    return token_ids


async def encode_prompt(
    prompt: str | list[int],
    tokenizer: Tokenizer,
    metrics: StageTimer,
    param: str,
    vocab_size: Callable[[], Awaitable[int]],
) -> list[int]:
    """A plain prompt's token IDs: text is tokenized, IDs are checked against the backend's vocabulary
    (`vocab_size` is awaited only for IDs). An empty prompt is a 400 naming `param`."""
    if isinstance(prompt, str):
        return require_tokens(encode_text(tokenizer, prompt, metrics), param)
    return require_tokens(check_token_ids(prompt, await vocab_size(), param), param)
