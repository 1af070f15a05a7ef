"""The streaming clients of `kvrelay bench serve`: one request body and one SSE event reader per protocol.

Every event is timed as it arrives: TTFT is the first event that carries text, ITL the gaps between text
events, e2e the end of the stream. Token counts come from the usage the stream reports (chat and
completions: the `stream_options.include_usage` chunk; Responses: `response.completed`; Anthropic:
`message_start` and `message_delta`); a server that reports none (some peers) leaves the completion
count at the number of text events, and the record says so (`tokens_from_usage` false).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

ANTHROPIC_VERSION = "2023-06-01"
PATHS = {
    "openai-chat": "/v1/chat/completions",
    "openai-completions": "/v1/completions",
    "responses": "/v1/responses",
    "anthropic": "/v1/messages",
}


@dataclass(frozen=True)
class SendOptions:
    model: str
    max_tokens: int
    api_key: str | None = None
    ignore_eos: bool = False


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds, `start_s` from the start of the run."""

    job: int
    turn: int
    kind: str
    protocol: str
    tenant: str
    start_s: float
    status: str = "in_flight"  # then ok | cancelled | error | timeout
    ttft_s: float | None = None
    e2e_s: float | None = None
    deltas_s: list[float] = field(default_factory=list)  # each text event, from the request's start
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_from_usage: bool = False
    error: str | None = None
    text: str = ""

    def as_json(self) -> dict[str, Any]:
        body = dict(self.__dict__)
        body.pop("text")
        return body


def _completions_prompt(system: str, messages: list[dict[str, str]]) -> str:
    lines = [system, ""]
    lines += [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def request_body(protocol: str, system: str, messages: list[dict[str, str]], opts: SendOptions) -> dict:
    """The streamed request of `protocol` for a conversation (`messages` alternate user and assistant)."""
    base: dict[str, Any] = {"model": opts.model, "stream": True, "temperature": 0}
    if protocol == "anthropic":
        return base | {"system": system, "messages": messages, "max_tokens": opts.max_tokens}
    if protocol == "responses":
        return base | {"instructions": system, "input": messages, "max_output_tokens": opts.max_tokens}
    extra = {"ignore_eos": True} if opts.ignore_eos else {}
    usage = {"stream_options": {"include_usage": True}}
    if protocol == "openai-completions":
        prompt = _completions_prompt(system, messages)
        return base | usage | extra | {"prompt": prompt, "max_tokens": opts.max_tokens}
    chat = [{"role": "system", "content": system}, *messages]
    return base | usage | extra | {"messages": chat, "max_tokens": opts.max_tokens}


def headers(protocol: str, api_key: str | None) -> dict[str, str]:
    out = {"anthropic-version": ANTHROPIC_VERSION} if protocol == "anthropic" else {}
    if api_key:
        out |= {"x-api-key": api_key} if protocol == "anthropic" else {"authorization": f"Bearer {api_key}"}
    return out


@dataclass
class Parsed:
    """What one event says: text, usage counts (prompt, cached, completion; any may be None), an error."""

    text: str = ""
    prompt: int | None = None
    cached: int | None = None
    completion: int | None = None
    error: str | None = None


def _openai_usage(usage: dict[str, Any]) -> Parsed:
    details = usage.get("prompt_tokens_details") or {}
    return Parsed(
        prompt=usage.get("prompt_tokens"),
        cached=details.get("cached_tokens"),
        completion=usage.get("completion_tokens"),
    )


def _parse_openai(data: dict[str, Any]) -> Parsed:
    if "error" in data:
        return Parsed(error=json.dumps(data["error"])[:300])
    parsed = _openai_usage(data["usage"]) if data.get("usage") else Parsed()
    for choice in data.get("choices") or []:
        parsed.text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
    return parsed


def _parse_responses(data: dict[str, Any]) -> Parsed:
    kind = data.get("type")
    if kind == "response.output_text.delta":
        return Parsed(text=data.get("delta") or "")
    if kind in ("error", "response.failed"):
        return Parsed(error=json.dumps(data.get("error") or data.get("response", {}).get("error"))[:300])
    if kind in ("response.completed", "response.incomplete"):
        usage = data["response"].get("usage") or {}
        details = usage.get("input_tokens_details") or {}
        return Parsed(
            prompt=usage.get("input_tokens"),
            cached=details.get("cached_tokens"),
            completion=usage.get("output_tokens"),
        )
    return Parsed()


def _parse_anthropic(data: dict[str, Any]) -> Parsed:
    kind = data.get("type")
    if kind == "content_block_delta":
        return Parsed(text=(data.get("delta") or {}).get("text") or "")
    if kind == "error":
        return Parsed(error=json.dumps(data.get("error"))[:300])
    usage = (data.get("message") or {}).get("usage") if kind == "message_start" else data.get("usage")
    if kind not in ("message_start", "message_delta") or not usage:
        return Parsed()
    uncached, cached = usage.get("input_tokens"), usage.get("cache_read_input_tokens")
    prompt = None if uncached is None else uncached + (cached or 0)
    completion = usage.get("output_tokens") if kind == "message_delta" else None
    return Parsed(prompt=prompt, cached=cached, completion=completion)


PARSERS = {
    "openai-chat": _parse_openai,
    "openai-completions": _parse_openai,
    "responses": _parse_responses,
    "anthropic": _parse_anthropic,
}


def _apply(record: RequestRecord, parsed: Parsed, since_start: float) -> None:
    if parsed.text:
        record.text += parsed.text
        record.deltas_s.append(since_start)
        if record.ttft_s is None:
            record.ttft_s = since_start
    for name, value in (("prompt", parsed.prompt), ("cached", parsed.cached)):
        if value is not None:
            setattr(record, f"{name}_tokens", value)
    if parsed.completion is not None:
        record.completion_tokens, record.tokens_from_usage = parsed.completion, True
    if parsed.error:
        record.status, record.error = "error", parsed.error


async def stream(
    client: httpx.AsyncClient,
    record: RequestRecord,
    system: str,
    messages: list[dict[str, str]],
    opts: SendOptions,
    cancel_after_first_delta: bool = False,
) -> None:
    """Send one streamed request and fill `record` as its events arrive (`record.status` says how it
    ended). An HTTP error status or a transport failure is an `error` record, never an exception."""
    protocol = record.protocol
    body = request_body(protocol, system, messages, opts)
    t0 = time.perf_counter()
    try:
        async with client.stream(
            "POST", PATHS[protocol], json=body, headers=headers(protocol, opts.api_key)
        ) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:300]
                record.status, record.error = "error", f"HTTP {r.status_code}: {detail}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() in ("", "[DONE]"):
                    continue
                _apply(record, PARSERS[protocol](json.loads(line[5:])), time.perf_counter() - t0)
                if cancel_after_first_delta and record.ttft_s is not None:
                    record.status = "cancelled"
                    break
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        record.status, record.error = "error", f"{type(exc).__name__}: {exc}"[:300]
    finally:
        record.e2e_s = time.perf_counter() - t0
    if record.status == "in_flight":
        record.status = "ok" if record.ttft_s is not None or record.tokens_from_usage else "error"
        record.error = None if record.status == "ok" else "the stream carried no text"
    if not record.tokens_from_usage and record.status == "ok":
        record.completion_tokens = len(record.deltas_s)  # no usage reported: one token per text event
