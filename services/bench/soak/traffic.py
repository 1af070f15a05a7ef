"""The traffic of `kvrelay bench soak`: a seeded mix of every public protocol, streamed and not, with tool
calls, structured output and cancels, sent at Poisson arrivals for a set time.

Each request is one of KINDS, drawn with the weights there (cancels are 3 in 20: 15%, above the 10% a
soak must hold). A cancel streams one of the four protocols and drops the connection at its first event
(the codec sends it once the first token exists: the request is cancelled mid-decode). Every request is
counted by how it ended (`Outcomes`): `ok` (a stream only once its protocol's terminal event came),
`cancelled`, `client_error` (a 4xx), `server_error` (a 5xx, an error event inside a 200 stream, a stream
that ends without its terminal event, a dropped connection or a timeout: anything the server should never
do to a well-formed request). The client's own cancels are not errors.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from services.bench.serve.clients import ANTHROPIC_VERSION, PATHS

KINDS = {  # kind -> weight out of 20
    "chat-stream": 3,
    "completions-stream": 2,
    "responses-stream": 2,
    "anthropic-stream": 2,
    "chat": 2,
    "chat-tools": 2,
    "anthropic-tools": 1,
    "chat-structured": 2,
    "responses-structured": 1,
    "cancel": 3,
}
STREAM_PROTOCOLS = ("openai-chat", "openai-completions", "responses", "anthropic")
QUESTIONS = (
    "What is the capital of France?",
    "Why is the sky blue?",
    "Name three uses of copper.",
    "How does yeast make bread rise?",
    "What is a prime number?",
    "Describe a quiet harbour in winter.",
    "Write two sentences about a train crossing the mountains.",
    "What should I pack for a week of hiking?",
)
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}},
    "required": ["name", "country"],
}
REQUEST_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Request:
    kind: str
    protocol: str  # a key of PATHS
    body: dict[str, Any]
    stream: bool
    cancel: bool = False


def _openai_chat(model: str, question: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": question}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}


def _stream_body(protocol: str, model: str, question: str, max_tokens: int) -> dict[str, Any]:
    if protocol == "openai-chat":
        return _openai_chat(model, question, max_tokens, stream=True)
    if protocol == "openai-completions":
        prompt = f"Question: {question}\nAnswer:"
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    if protocol == "responses":
        return {"model": model, "input": question, "max_output_tokens": max_tokens, "stream": True}
    messages = [{"role": "user", "content": question}]
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True}


def make_request(kind: str, rng: random.Random, model: str, max_tokens: int) -> Request:
    """One request of `kind` with a question drawn from `rng`."""
    question = rng.choice(QUESTIONS)
    if kind == "cancel":
        protocol = rng.choice(STREAM_PROTOCOLS)
        return Request(kind, protocol, _stream_body(protocol, model, question, max_tokens), True, True)
    if kind.endswith("-stream"):
        protocol = {"chat": "openai-chat", "completions": "openai-completions"}.get(
            kind.removesuffix("-stream"), kind.removesuffix("-stream")
        )
        return Request(kind, protocol, _stream_body(protocol, model, question, max_tokens), True)
    if kind == "chat":
        return Request(kind, "openai-chat", _openai_chat(model, question, max_tokens), False)
    if kind == "chat-tools":
        tools = [{"type": "function", "function": WEATHER_TOOL}]
        body = _openai_chat(
            model, "What is the weather in Paris?", max_tokens, tools=tools, tool_choice="required"
        )
        return Request(kind, "openai-chat", body, False)
    if kind == "anthropic-tools":
        tool = {"name": WEATHER_TOOL["name"], "description": WEATHER_TOOL["description"],
                "input_schema": WEATHER_TOOL["parameters"]}  # fmt: skip
        body = _stream_body("anthropic", model, "What is the weather in Oslo?", max_tokens) | {
            "stream": False, "tools": [tool], "tool_choice": {"type": "any"}
        }  # fmt: skip
        return Request(kind, "anthropic", body, False)
    if kind == "chat-structured":
        schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}}
        body = _openai_chat(model, "Name a large city as JSON.", max_tokens, response_format=schema)
        return Request(kind, "openai-chat", body, False)
    if kind == "responses-structured":
        text = {"format": {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA}}
        body = {"model": model, "input": "Name a large city as JSON.", "max_output_tokens": max_tokens,
                "text": text}  # fmt: skip
        return Request(kind, "responses", body, False)
    raise ValueError(f"unknown soak request kind {kind!r}")


def _headers(protocol: str, api_key: str | None) -> dict[str, str]:
    out = {"anthropic-version": ANTHROPIC_VERSION} if protocol == "anthropic" else {}
    if api_key:
        out |= {"x-api-key": api_key} if protocol == "anthropic" else {"authorization": f"Bearer {api_key}"}
    return out


TERMINAL_TYPES = ("response.completed", "response.incomplete", "message_stop")


def _event(line: str) -> tuple[bool, bool]:
    """(is an error, is the stream's terminal event) for one SSE data line, in each protocol's own shape:
    chat and completions end with `[DONE]`, Responses with `response.completed` (or `.incomplete`),
    Anthropic with `message_stop`."""
    if line.strip() == "[DONE]":
        return False, True
    try:
        data = json.loads(line)
    except ValueError:
        return True, False
    if not isinstance(data, dict):
        return True, False
    error = "error" in data or data.get("type") in ("error", "response.failed")
    return error, data.get("type") in TERMINAL_TYPES


async def send(client: httpx.AsyncClient, request: Request, api_key: str | None) -> tuple[str, str | None]:
    """Send one request; its outcome and, for an error, a short reason (never the text)."""
    path, headers = PATHS[request.protocol], _headers(request.protocol, api_key)
    try:
        if not request.stream:
            response = await client.post(path, json=request.body, headers=headers)
            return _status_outcome(
                response.status_code
            ), None if response.status_code < 400 else response.text[:200]
        async with client.stream("POST", path, json=request.body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:200]
                return _status_outcome(response.status_code), detail
            async for line in response.aiter_lines():
                if not line.startswith("data:") or not line[5:].strip():
                    continue
                error, terminal = _event(line[5:])
                if error:
                    return "server_error", line[5:200]
                if terminal:
                    return "ok", None
                if request.cancel:
                    return "cancelled", None  # leaving the block closes the connection mid-stream
            return "server_error", "the stream ended without its terminal event"
    except httpx.HTTPError as exc:
        return "server_error", f"{type(exc).__name__}: {exc}"[:200]


def _status_outcome(status: int) -> str:
    return "ok" if status < 400 else "client_error" if status < 500 else "server_error"


@dataclass
class Outcomes:
    """Counts by kind and outcome, and the first few error reasons."""

    counts: Counter[tuple[str, str]] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    in_flight: int = 0

    def add(self, kind: str, outcome: str, reason: str | None) -> None:
        self.counts[(kind, outcome)] += 1
        if reason is not None and len(self.errors) < 20:
            self.errors.append(f"{kind} {outcome}: {reason}")

    def total(self, outcome: str | None = None) -> int:
        return sum(n for (_, o), n in self.counts.items() if outcome is None or o == outcome)

    def as_json(self) -> dict[str, Any]:
        by_kind: dict[str, dict[str, int]] = {}
        for (kind, outcome), n in sorted(self.counts.items()):
            by_kind.setdefault(kind, {})[outcome] = n
        outcomes = ("ok", "cancelled", "client_error", "server_error")
        return {"total": self.total(), **{o: self.total(o) for o in outcomes}, "by_kind": by_kind,
                "errors": self.errors}  # fmt: skip


@dataclass(frozen=True)
class Traffic:
    rate: float  # requests/s, Poisson
    duration_s: float
    max_tokens: int
    seed: int
    second_share: float = 0.0  # of the requests, sent to the second client


async def drive(
    clients: Sequence[httpx.AsyncClient], model: str, api_key: str | None, plan: Traffic, outcomes: Outcomes
) -> None:
    """Poisson arrivals for the plan's duration, then wait for every request still running. Each goes to
    `clients[0]`, or with `plan.second_share` to `clients[1]`."""
    rng = random.Random(plan.seed)
    kinds, weights = list(KINDS), list(KINDS.values())
    tasks: set[asyncio.Task[None]] = set()

    async def one(client: httpx.AsyncClient, request: Request) -> None:
        outcomes.in_flight += 1
        try:
            outcome, reason = await send(client, request, api_key)
        finally:
            outcomes.in_flight -= 1
        outcomes.add(request.kind, outcome, reason)

    t0 = time.monotonic()
    at = 0.0
    while at < plan.duration_s:
        await asyncio.sleep(max(0.0, at - (time.monotonic() - t0)))
        request = make_request(rng.choices(kinds, weights)[0], rng, model, plan.max_tokens)
        client = clients[1] if len(clients) > 1 and rng.random() < plan.second_share else clients[0]
        task = asyncio.create_task(one(client, request))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        at += rng.expovariate(plan.rate)
    if tasks:
        await asyncio.gather(*tasks)
