"""What both `kvrelay bench kv-tiers` scenarios share: a phase of turns over every session, the workers'
tier counters, and waits on the stack's status (kv_tiers.py: restart and rescale; kv_tiers_busy.py: a busy
replica)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx

from services.bench.routing.workload import (
    REQUEST_TIMEOUT_S,
    Conversation,
    Sender,
    TurnResult,
    WorkloadPlan,
    build_conversations,
)
from services.bench.stats import percentile
from services.codec.text.tokenizer import Tokenizer
from services.common.status_client import StackUnreachableError, fetch_status
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

WAIT_S = 300.0
SETTLE_S = 30.0
POLL_S = 0.2


@asynccontextmanager
async def sessions(
    url: str, model: Path, plan: WorkloadPlan
) -> AsyncIterator[tuple[Sender, list[Conversation]]]:
    """A sender to the stack at `url`, and the plan's conversations, each opening with the shared system
    prompt."""
    tokenizer = Tokenizer.from_dir(model)
    system, conversations = build_conversations(plan, tokenizer)
    for conversation in conversations:
        conversation.messages = [{"role": "system", "content": system}]
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S, trust_env=False) as client:
        model_id = (await client.get("/v1/models")).json()["data"][0]["id"]
        yield Sender(client, model_id, tokenizer, plan), conversations


async def run_phase(workers: Workers, sender: Sender, conversations: list[Conversation], turns: Any
                 ) -> dict[str, Any]:  # fmt: skip
    """`turns` in order, each sent for every session at once: the summary and the tier counters' growth."""
    before = _fetched_tokens(workers)
    results: list[TurnResult] = []
    errors: list[str] = []
    for turn in turns:
        sent = await asyncio.gather(*(_turn(sender, c, turn) for c in conversations), return_exceptions=True)
        for conversation, outcome in zip(conversations, sent, strict=True):
            if isinstance(outcome, BaseException):
                errors.append(
                    f"session {conversation.index} turn {turn}: {type(outcome).__name__}: {outcome}"[:400]
                )
            else:
                results.append(outcome)
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    ttft = [r.ttft_s for r in results]
    return {
        "requests": len(results),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tier_fetched_tokens": _fetched_tokens(workers) - before,
        "errors": errors,
    }


async def _turn(sender: Sender, conversation: Conversation, turn: int) -> TurnResult:
    user = [conversation.first_user, *conversation.follow_ups][turn]
    conversation.messages.append({"role": "user", "content": user})
    result, reply = await sender.send(conversation, turn, time.perf_counter())
    conversation.messages.append({"role": "assistant", "content": reply})
    return result


def _fetched_tokens(workers: Workers) -> int:
    """Prompt tokens the running workers loaded from the tiers so far (each one's Load, asked directly:
    the router's copy lags)."""
    total = 0
    for address in workers.addresses:
        with grpc.insecure_channel(address) as channel:
            try:
                load = worker_pb2_grpc.WorkerStub(channel).Load(
                    pb.LoadRequest(), metadata=workers.metadata, timeout=5
                )
            except grpc.RpcError:
                continue  # not started yet
        total += load.kv_tier_fetched_tokens_total
    return total


@dataclass(frozen=True)
class Workers:
    addresses: list[str]
    metadata: tuple[tuple[str, str], ...]


def wait_writes_settled(url: str, name: str) -> None:
    """Until `name`'s bytes written to its tiers are above zero and stop growing (two polls 2 s apart, past
    the router's load refresh, agree), for at most SETTLE_S: a worker killed right after a turn loses the
    writes still queued, and this measures a restart, not that. Nothing to wait for without tiers."""
    last: int | None = None

    def settled() -> bool:
        nonlocal last
        try:
            services = fetch_status(url)["services"]
        except StackUnreachableError:
            return False
        (worker,) = [s for s in services if s.get("name") == name]
        if not worker.get("kv_tiers"):
            return True
        written = sum(int(t["written_bytes"]) for t in worker["kv_tiers"])
        done, last = written > 0 and written == last, written
        return done

    deadline = time.monotonic() + SETTLE_S
    while not settled() and time.monotonic() < deadline:
        time.sleep(2.0)


def wait_ready(url: str, name: str) -> None:
    """Until the router reports `name` ready with no request served yet (a fresh process)."""

    def ready() -> bool:
        try:
            services = fetch_status(url)["services"]
        except StackUnreachableError:
            return False
        return any(s.get("name") == name and s.get("ready") and not s.get("requests_total") for s in services)

    wait_for(ready, f"the router using a fresh {name}")


def wait_for(condition: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {WAIT_S:.0f} s")
        time.sleep(POLL_S)
