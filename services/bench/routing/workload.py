"""The workload of `kvrelay bench routing`: seeded multi-turn conversations, driven over streaming HTTP.

Every session shares one long system prompt and opens with its own long user message; its follow-ups
are short, and each turn's prompt is the whole conversation so far (the replies included), so a turn's
prompt extends the previous one. Texts are random words from a fixed list, sized in tokens with the
model's own tokenizer, from one seed: the same seed gives the same conversations for every policy (the
replies too, at temperature 0, as long as both stacks generate alike).

Sessions run concurrently; the turns of one session one after another. Each request streams and its
usage chunk (`stream_options.include_usage`) gives prompt, cached and completion tokens. TTFT is the
time from sending the request to the first chunk that carries text.

How a request reaches the stack depends on `session` (what the router's session affinity sees):
- `none`: the conversation is rendered with the model's chat template here and sent to /v1/completions
  as token IDs, without a session header: the tokens a chat request would carry, but no session key, so
  the router's prefix index (and its policy) alone places every turn;
- `derived`: /v1/chat/completions without a header: the codec keys the session on the first user turn
  (a plain chat client's case);
- `header`: /v1/chat/completions with `x-session-id`.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from services.bench.stats import percentile
from services.codec.session import SESSION_HEADER
from services.codec.text.chat_template import chat_template_from_tokenizer, render_and_encode
from services.codec.text.tokenizer import Tokenizer

SESSION_MODES = ("none", "derived", "header")
REQUEST_TIMEOUT_S = 600.0
_WORD_TEXT = (
    "account active address answer archive balance batch billing branch buffer cache capacity carrier "
    "channel charge checkout client cluster config contract credit customer cycle data delay delivery "
    "deposit device discount dispatch document domain draft driver export failure fee field filter form "
    "freight gateway holder invoice issue item journal label ledger license limit list login manifest "
    "margin meter module network notice offer order outage owner package parcel partner payment period "
    "plan policy portal premium price profile quota rate receipt record refund region renewal report "
    "request reserve retry route schedule screen sector service session setting shipment signal status "
    "stock storage subscription supplier support surcharge system tariff ticket token transfer update "
    "upgrade usage user vendor version voucher warehouse window workflow zone"
)
WORDS = tuple(_WORD_TEXT.split())
FOLLOW_UPS = (
    "Can you say more about that?",
    "Summarize that in one sentence.",
    "What should I check first?",
    "Why would that happen?",
    "Is there a faster way?",
    "What is the next step?",
    "Could that affect other accounts?",
    "Give me one example.",
)


@dataclass(frozen=True)
class WorkloadPlan:
    sessions: int = 12
    turns: int = 4
    system_tokens: int = 300
    first_user_tokens: int = 200
    max_tokens: int = 16
    seed: int = 0
    session: str = "none"


@dataclass
class TurnResult:
    session: int
    turn: int
    start_s: float  # from the start of the run
    ttft_s: float
    end_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class Conversation:
    """One session's opening and follow-ups; `messages` grows as the turns are answered."""

    index: int
    first_user: str
    follow_ups: list[str]
    messages: list[dict[str, str]] = field(default_factory=list)


def _sized_text(rng: random.Random, tokenizer: Tokenizer, lead: str, num_tokens: int) -> str:
    """`lead` followed by random words (sentences of 12) until the text is about `num_tokens` tokens."""
    words: list[str] = []
    text = lead
    while len(tokenizer.encode(text)) < num_tokens:
        words.extend(rng.choice(WORDS) for _ in range(12))
        text = lead + " " + " ".join(words) + "."
    return text


def build_conversations(plan: WorkloadPlan, tokenizer: Tokenizer) -> tuple[str, list[Conversation]]:
    """The shared system prompt and one conversation per session, all from `plan.seed`."""
    rng = random.Random(plan.seed)
    system = _sized_text(
        rng,
        tokenizer,
        "You are the support assistant of a logistics company. Reference notes:",
        plan.system_tokens,
    )
    conversations = []
    for i in range(plan.sessions):
        lead = f"Ticket {rng.randrange(10**6):06d}: {rng.choice(WORDS)} {rng.choice(WORDS)} problem, log:"
        first_user = _sized_text(rng, tokenizer, lead, plan.first_user_tokens)
        follow_ups = [rng.choice(FOLLOW_UPS) for _ in range(plan.turns - 1)]
        conversations.append(Conversation(i, first_user, follow_ups))
    return system, conversations


class Sender:
    """Sends one turn of a conversation the way `session` asks, and times it."""

    def __init__(
        self, client: httpx.AsyncClient, model: str, tokenizer: Tokenizer, plan: WorkloadPlan
    ) -> None:
        self.client = client
        self.model = model
        self.tokenizer = tokenizer
        self.template = chat_template_from_tokenizer(tokenizer)
        self.plan = plan
        self.run_id = f"{plan.seed}-{time.time_ns()}"

    def _request(self, conversation: Conversation) -> tuple[str, dict[str, Any], dict[str, str]]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.plan.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        headers: dict[str, str] = {}
        if self.plan.session == "header":
            headers[SESSION_HEADER] = f"bench-routing-{self.run_id}-{conversation.index}"
        if self.plan.session == "none":
            body["prompt"] = render_and_encode(self.template, self.tokenizer, conversation.messages)
            return "/v1/completions", body, headers
        body["messages"] = conversation.messages
        return "/v1/chat/completions", body, headers

    async def send(self, conversation: Conversation, turn: int, t0: float) -> tuple[TurnResult, str]:
        """One streamed request: its timings and usage, and the reply text."""
        path, body, headers = self._request(conversation)
        start = time.perf_counter()
        first: float | None = None
        pieces: list[str] = []
        usage: dict[str, Any] = {}
        async with self.client.stream("POST", path, json=body, headers=headers) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"{path} answered {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text = _chunk_text(chunk)
                if text:
                    first = first or time.perf_counter()
                    pieces.append(text)
        end = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        result = TurnResult(
            session=conversation.index,
            turn=turn,
            start_s=start - t0,
            ttft_s=(first or end) - start,
            end_s=end - t0,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens", 0)),
            completion_tokens=int(usage.get("completion_tokens", 0)),
        )
        return result, "".join(pieces)


def _chunk_text(chunk: dict[str, Any]) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    text = choice["delta"].get("content") if "delta" in choice else choice.get("text")
    return text or ""


async def _session(sender: Sender, system: str, conversation: Conversation, t0: float,
                   results: list[TurnResult], errors: list[str]) -> None:  # fmt: skip
    conversation.messages = [{"role": "system", "content": system}]
    for turn, user in enumerate([conversation.first_user, *conversation.follow_ups]):
        conversation.messages.append({"role": "user", "content": user})
        try:
            result, reply = await sender.send(conversation, turn, t0)
        except (httpx.HTTPError, RuntimeError, ValueError) as exc:
            errors.append(f"session {conversation.index} turn {turn}: {type(exc).__name__}: {exc}"[:400])
            return
        results.append(result)
        conversation.messages.append({"role": "assistant", "content": reply})


async def run_workload(url: str, model_dir: Path, plan: WorkloadPlan) -> dict[str, Any]:
    """Every session concurrently against the stack at `url`: the per-turn results, errors, wall time."""
    tokenizer = Tokenizer.from_dir(model_dir)
    system, conversations = build_conversations(plan, tokenizer)
    results: list[TurnResult] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=plan.sessions + 4)
    async with httpx.AsyncClient(
        base_url=url, timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False
    ) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        sender = Sender(client, model, tokenizer, plan)
        t0 = time.perf_counter()
        await asyncio.gather(*(_session(sender, system, c, t0, results, errors) for c in conversations))
        wall_s = time.perf_counter() - t0
    results.sort(key=lambda r: (r.session, r.turn))
    return {"turns": results, "errors": errors, "wall_s": wall_s}


def _hit_rate(turns: Sequence[TurnResult]) -> dict[str, Any]:
    prompt = sum(t.prompt_tokens for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    return {
        "requests": len(turns),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
    }


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    """Hit rates (all turns, first turns, follow-ups), TTFT percentiles and throughput of one run."""
    turns: list[TurnResult] = run["turns"]
    follow_ups = [t for t in turns if t.turn > 0]
    ttft = [t.ttft_s for t in turns]
    wall_s: float = run["wall_s"]
    completion = sum(t.completion_tokens for t in turns)
    return {
        **_hit_rate(turns),
        "first_turns": _hit_rate([t for t in turns if t.turn == 0]),
        "follow_ups": _hit_rate(follow_ups),
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "follow_up_ttft_p50_s": percentile([t.ttft_s for t in follow_ups], 50),
        "wall_s": wall_s,
        "completion_tokens": completion,
        "completion_tok_s": completion / wall_s if wall_s > 0 else None,
        "requests_per_s": len(turns) / wall_s if wall_s > 0 else None,
        "errors": run["errors"],
    }
