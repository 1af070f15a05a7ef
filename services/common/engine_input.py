"""What a request hands an engine, checked once where it enters a process and carried checked after that.

`check_request` is the one check of a request's values: its ID (non-empty, printable ASCII, at most
MAX_REQUEST_ID_LEN), its prompt (at least one token, each in [0, vocab_size): C passes over the list, not
a Python loop per token), its sampling settings (`SamplingParams.validate`, stop token IDs inside the
vocabulary) and its cache salt. It returns an `EngineInput`, the checked type. A worker builds one from the
wire (proto_convert.engine_input_from_proto); `kvrelay generate`, the benches and tests enter through the
engine's raw-argument methods (`EngineCore.add_request`, `AsyncEngine.generate`), which call it. Past that
point nothing checks the same values again: the engine's `add`/`start` take the `EngineInput` as it is.

Facts that depend on a process's state are checked once too, by whoever holds that state: a duplicate
request ID by the process's one registry of live IDs (the router's, the worker's; the engine's own when it
is used as a library), the context length by the engine that knows its `max_model_len`.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass

from services.common.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    TokenOutOfRangeError,
)
from services.common.sampling import SamplingParams

MAX_REQUEST_ID_LEN = 128  # the codec's own are 28 characters: req_ and 24 hex digits
MAX_CACHE_SALT_BYTES = 64  # the codec's are 16
MAX_CACHE_BREAKPOINTS = 4  # Anthropic's limit; OpenAI's prompt_cache_retention is one
MAX_CACHE_TTL_S = 24 * 3600  # OpenAI's "24h", the longest lifetime a client can ask for


@dataclass(frozen=True)
class CacheBreakpoint:
    """The client asked that the prompt's first `num_tokens` tokens be kept below the pool for `ttl_s`
    seconds at least (Anthropic `cache_control`, OpenAI `prompt_cache_retention`; docs/kv-tiers.md)."""

    num_tokens: int
    ttl_s: int


@dataclass(frozen=True)
class EngineInput:
    """A request's values, checked by `check_request` (build it there, not by hand)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: bytes = b""
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()
    # An encoder-decoder model's encoder input (prompt_token_ids are then the decoder's first tokens).
    encoder_token_ids: tuple[int, ...] = ()


def check_request(
    request_id: str,
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    *,
    priority: int = 0,
    cache_salt: bytes = b"",
    cache_breakpoints: Sequence[CacheBreakpoint] = (),
    encoder_token_ids: Sequence[int] = (),
) -> EngineInput:
    """The request's values, each checked; InvalidRequestError (a 400, INVALID_ARGUMENT) names the first
    one out of range."""
    check_request_id(request_id)
    prompt = check_prompt(prompt_token_ids, vocab_size)
    params.validate(vocab_size)
    if len(cache_salt) > MAX_CACHE_SALT_BYTES:
        message = f"cache_salt holds {len(cache_salt)} bytes; the limit is {MAX_CACHE_SALT_BYTES}"
        raise InvalidRequestError(message, param="cache_salt")
    breakpoints = check_cache_breakpoints(cache_breakpoints, len(prompt))
    source = tuple(check_prompt(encoder_token_ids, vocab_size)) if encoder_token_ids else ()
    return EngineInput(request_id, prompt, params, priority, bytes(cache_salt), breakpoints, source)


def cache_written_tokens(
    breakpoints: Sequence[CacheBreakpoint], num_cached_tokens: int, block_size: int
) -> tuple[int, ...]:
    """For each breakpoint, the prompt tokens up to it (whole blocks: the granularity of what is kept)
    that a request which found `num_cached_tokens` cached computed, past the earlier breakpoints' share."""
    written, done = [], num_cached_tokens
    for point in breakpoints:
        end = point.num_tokens // block_size * block_size
        written.append(max(0, end - done))
        done = max(done, end)
    return tuple(written)


def check_cache_breakpoints(
    breakpoints: Sequence[CacheBreakpoint], num_prompt_tokens: int
) -> tuple[CacheBreakpoint, ...]:
    """At most MAX_CACHE_BREAKPOINTS, in prompt order, inside the prompt, each kept 1 s to MAX_CACHE_TTL_S."""
    if len(breakpoints) > MAX_CACHE_BREAKPOINTS:
        message = f"{len(breakpoints)} cache breakpoints; the limit is {MAX_CACHE_BREAKPOINTS}"
        raise InvalidRequestError(message, param="cache_breakpoints")
    previous = 0
    for point in breakpoints:
        if not previous <= point.num_tokens <= num_prompt_tokens or not 0 < point.ttl_s <= MAX_CACHE_TTL_S:
            message = (
                f"cache breakpoints must be in prompt order, inside the prompt ({num_prompt_tokens} tokens), "
                f"each kept 1 to {MAX_CACHE_TTL_S} s; got {point.num_tokens} tokens for {point.ttl_s} s"
            )
            raise InvalidRequestError(message, param="cache_breakpoints")
        previous = point.num_tokens
    return tuple(breakpoints)


def check_request_id(request_id: str) -> str:
    """A request ID names one stream in every service it crosses: 1 to MAX_REQUEST_ID_LEN printable
    ASCII characters (it goes into logs and metadata)."""
    if not request_id:
        raise InvalidRequestError("request_id must not be empty", param="request_id")
    if len(request_id) > MAX_REQUEST_ID_LEN or not (request_id.isascii() and request_id.isprintable()):
        raise InvalidRequestError(
            f"request_id must be at most {MAX_REQUEST_ID_LEN} printable ASCII characters", param="request_id"
        )
    return request_id


def check_prompt(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """The prompt's token IDs as a list, none missing and each an int in [0, vocab_size). Three passes in C
    over the list (min, max and sum: a float, a string or a numpy scalar among the IDs shows in the sum's
    type or raises there), not a Python loop per token: twice as fast at 4,096 tokens (docs/architecture.md,
    "Each fact checked once per process")."""
    ids = list(token_ids)
    if not ids:
        raise EmptyPromptError()
    try:
        low, high, total = min(ids), max(ids), sum(ids)
        is_valid = type(total) is int and low >= 0 and high < vocab_size
    except TypeError:  # a string among ints
        is_valid = False
    if not is_valid:
        bad = next(t for t in ids if type(t) not in (int, bool) or not 0 <= t < vocab_size)
        raise TokenOutOfRangeError(bad, vocab_size)
    return ids


def check_unique(request_id: str, live: Container[str]) -> None:
    """A process's one duplicate check: DuplicateRequestError when `request_id` is among its `live` IDs
    (the router's and the worker's in-flight sets, AsyncEngine's open streams)."""
    if request_id in live:
        raise DuplicateRequestError(f"request {request_id!r} is already in flight")


def check_encoder_input(encoder_token_ids: Sequence[int], is_encoder_decoder: bool, max_len: int) -> None:
    """An encoder-decoder model needs an encoder input of 1 to `max_len` tokens (its source is never
    chunked, and its positions end there); a decoder-only model takes none. InvalidRequestError (400)."""
    if not is_encoder_decoder:
        if encoder_token_ids:
            raise InvalidRequestError(
                "this model is decoder-only: it takes no encoder input", param="encoder_token_ids"
            )
        return
    if not encoder_token_ids:
        raise InvalidRequestError(
            "this model is an encoder-decoder: a request needs a non-empty encoder input", param="prompt"
        )
    if len(encoder_token_ids) > max_len:
        raise InvalidRequestError(
            f"the encoder input holds {len(encoder_token_ids)} tokens; this model reads at most {max_len}",
            param="prompt",
        )
