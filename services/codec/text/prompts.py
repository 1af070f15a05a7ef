"""Prompts to token IDs: chat messages through the template, raw text, or IDs checked against the vocabulary.

Shared by the protocol routes and /tokenize, so a /tokenize count is exactly what a request would use.
Template and tokenizer time are recorded per stage by the caller's `StageTimer` (the codec's metrics).

This is work done before admission (the token count is what quotas charge), so `PromptEncoder` bounds
it: the rendered text is refused over `limits.max_input_bytes` before the tokenizer sees it, and
rendering and tokenizing run in at most `limits.prompt_workers` threads at once, off the event loop, so
a large prompt never stalls other requests' streams.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import anyio
import anyio.to_thread

from services.codec.text.chat_template import ChatTemplate
from services.codec.text.tokenizer import Tokenizer
from services.common.errors import InvalidRequestError
from services.common.grammar import GrammarCompiler, GrammarError, GrammarSpec


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
    max_bytes: int | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    variables: Mapping[str, Any] | None = None,
) -> list[int]:
    """The template writes the special tokens, so the text is encoded without adding any. `tools` and
    `variables` (e.g. `enable_thinking`) reach the template as its variables."""
    with metrics.time_stage("template"):
        text = template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools, **dict(variables or {})
        )
    check_text_bytes(text, max_bytes, "messages")
    with metrics.time_stage("tokenize"):
        return tokenizer.encode(text, add_special_tokens=False)


Conversation = tuple[Sequence[Mapping[str, Any]], Sequence[Mapping[str, Any]] | None]  # messages, tools


def shared_prefix_lengths(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    conversation: Conversation,
    variants: Sequence[Conversation | None],
    variables: Mapping[str, Any] | None = None,
) -> list[int]:
    """For each variant of `conversation` (the one `prompt_ids` encodes, with the generation prompt), the
    prompt tokens that lie wholly inside the text both renderings start with. None stands for the whole
    prompt; a variant that renders the same text as the conversation, or that the template refuses, marks
    nothing and shares 0. The conversation is encoded once, with each token's end in the text."""
    extra = dict(variables or {})
    text = template.render(conversation[0], tools=conversation[1], **extra)
    ends = list(itertools.accumulate(tokenizer.token_ends(text), max))
    lengths = []
    for variant in variants:
        if variant is None:
            lengths.append(len(prompt_ids))
            continue
        try:
            other = template.render(variant[0], tools=variant[1], **extra)
        except InvalidRequestError:
            other = text
        chars = _shared_chars(text, other) if other != text else 0
        lengths.append(min(bisect.bisect_right(ends, chars), len(prompt_ids)))
    return lengths


def _shared_chars(a: str, b: str) -> int:
    """How many leading characters `a` and `b` share (by halving: slices compare in C)."""
    low, high = 0, min(len(a), len(b))
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def encode_text(
    tokenizer: Tokenizer,
    text: str,
    metrics: StageTimer,
    *,
    add_special_tokens: bool = True,
    max_bytes: int | None = None,
    param: str = "prompt",
) -> list[int]:
    check_text_bytes(text, max_bytes, param)
    with metrics.time_stage("tokenize"):
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def check_text_bytes(text: str, max_bytes: int | None, param: str) -> None:
    """A 400 naming `param` when `text` is over `max_bytes` in UTF-8 (None: no cap)."""
    if max_bytes is None or len(text) <= max_bytes // 4:  # 4 bytes per character at most: no count needed
        return
    num_bytes = len(text.encode("utf-8", "surrogatepass"))
    if num_bytes > max_bytes:
        raise InvalidRequestError(
            f"the prompt's text is {num_bytes} bytes, over the limit of {max_bytes} (limits.max_input_bytes)",
            param=param,
        )


class PromptEncoder:
    """`encode_chat` and `encode_text` under the byte cap, in a bounded pool of threads."""

    def __init__(self, tokenizer: Tokenizer, metrics: StageTimer, *, max_bytes: int, workers: int) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.max_bytes = max_bytes
        self.limiter = anyio.CapacityLimiter(workers)
        self._grammars: GrammarCompiler | None = None  # made on the first constraint (~0.5 s)

    async def check_grammar(self, spec: GrammarSpec, param: str) -> None:
        """Compiles `spec` against the tokenizer in the pool (cached): a GrammarError naming `param` when
        it cannot, before the request is queued. The workers compile it again (a cache hit there too)."""
        try:
            await anyio.to_thread.run_sync(self._compile, spec, limiter=self.limiter)
        except GrammarError as exc:
            exc.param = param
            raise

    def _compile(self, spec: GrammarSpec) -> None:
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer.to_json(), self.tokenizer.eos_token_ids)
        with self.metrics.time_stage("grammar"):
            self._grammars.compile(spec)

    async def chat(
        self,
        template: ChatTemplate,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        work = functools.partial(
            encode_chat,
            template,
            self.tokenizer,
            messages,
            self.metrics,
            add_generation_prompt=add_generation_prompt,
            max_bytes=self.max_bytes,
            tools=tools,
            variables=variables,
        )
        return await anyio.to_thread.run_sync(work, limiter=self.limiter)

    async def shared_prefix_lengths(
        self,
        template: ChatTemplate,
        prompt_ids: Sequence[int],
        conversation: Conversation,
        variants: Sequence[Conversation | None],
        variables: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """`shared_prefix_lengths` in the pool (one render per variant, one encode in all)."""
        work = functools.partial(
            shared_prefix_lengths, template, self.tokenizer, prompt_ids, conversation, variants, variables
        )
        return await anyio.to_thread.run_sync(work, limiter=self.limiter)

    async def text(self, text: str, *, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        work = functools.partial(
            encode_text,
            self.tokenizer,
            text,
            self.metrics,
            add_special_tokens=add_special_tokens,
            max_bytes=self.max_bytes,
            param=param,
        )
        return await anyio.to_thread.run_sync(work, limiter=self.limiter)


def default_workers() -> int:
    """The CPUs this process may run on (its affinity, as a container's cpuset sets it), at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


async def encode_decoder_prompt(
    prompt: str | list[int] | None, encoder: PromptEncoder, vocab_size: Callable[[], Awaitable[int]]
) -> list[int] | None:
    """An encoder-decoder request's decoder prompt (what follows the decoder's start token): text is
    tokenized without special tokens, IDs are checked; None when the request has none. It may be empty."""
    if prompt is None:
        return None
    if isinstance(prompt, str):
        return await encoder.text(prompt, add_special_tokens=False, param="decoder_prompt") if prompt else []
    return check_token_ids(prompt, await vocab_size(), "decoder_prompt")


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
    encoder: PromptEncoder,
    param: str,
    vocab_size: Callable[[], Awaitable[int]],
    *,
    empty_text_ok: bool = True,
) -> list[int]:
    """A plain prompt's token IDs: text is tokenized, IDs are checked against the backend's vocabulary
    (`vocab_size` is awaited only for IDs). An empty prompt is a 400 naming `param`, and so is empty text
    unless `empty_text_ok` (an encoder-decoder model's encoder would read its EOS alone)."""
    if isinstance(prompt, str):
        if not (prompt or empty_text_ok):
            raise InvalidRequestError("the prompt is empty: the encoder needs text to read", param=param)
        return require_tokens(await encoder.text(prompt, param=param), param)
    return require_tokens(check_token_ids(prompt, await vocab_size(), param), param)
