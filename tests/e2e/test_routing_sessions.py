"""Two colocated workers behind the router: multi-turn sessions sharing one system prompt find their KV
where they left it, and neither worker takes the lion's share. Driven with the strict openai SDK."""

from __future__ import annotations

import concurrent.futures
import itertools
from pathlib import Path

import pytest
from openai import OpenAI

from tests.integration.test_up import UpStack, start_up, status_json
from tests.reference_prompts import long_text
from tests.stack_helpers import wait_until

SYSTEM = "You are a careful assistant for a travel agency. Answer briefly and politely.\n" + long_text(6, 3)
NUM_SESSIONS = 12
NUM_TURNS = 4


@pytest.fixture(scope="module")
def two_workers(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> UpStack:
    # Room for every session's conversation on either worker (KV is fp32 under bf16 compute: 720 KiB a
    # block), so a miss here means routing sent a turn to the wrong worker, not that its blocks were evicted.
    config = "engine:\n  kv_cache_memory_mb: 512\n  max_model_len: 2048\n"
    stack = start_up(
        model_dir, tmp_path_factory.mktemp("routing"), "--workers", "2", free_ports=True, config_text=config
    )
    yield stack  # type: ignore[misc]
    stack.stop()


def run_session(client: OpenAI, model: str, i: int) -> list[tuple[int, int]]:
    """(prompt_tokens, cached_tokens) per turn."""
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Traveller {i} writes: " + long_text(3, i)},
    ]
    usage = []
    for turn in range(NUM_TURNS):
        reply = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=12,
            temperature=0.0,  # type: ignore[arg-type]
        )
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        usage.append((reply.usage.prompt_tokens, reply.usage.prompt_tokens_details.cached_tokens or 0))
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        messages.append({"role": "user", "content": f"Thanks. And what about question {turn + 2}?"})
    return usage


def worker_requests(stack: UpStack) -> list[int]:
    services = status_json(stack.url)["services"]
    return [s["requests_total"] for s in services if s["role"] == "colocated"]


def test_follow_up_turns_hit_their_cache_and_load_stays_balanced(two_workers: UpStack) -> None:
    client = OpenAI(
        base_url=f"{two_workers.url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )
    model = client.models.list().data[0].id
    before = worker_requests(two_workers)
    with concurrent.futures.ThreadPoolExecutor(NUM_SESSIONS) as pool:
        sessions = list(pool.map(lambda i: run_session(client, model, i), range(NUM_SESSIONS)))
    for usage in sessions:
        for (previous_prompt, _), (_, cached) in itertools.pairwise(usage):
            assert cached >= 0.8 * previous_prompt, f"a follow-up found only {cached} of {previous_prompt}"

    # The router reports each replica's load from its last probe: wait for the probes to count every turn.
    def served() -> list[int]:
        return [a - b for a, b in zip(worker_requests(two_workers), before, strict=True)]

    wait_until(
        lambda: sum(served()) >= NUM_SESSIONS * NUM_TURNS, 30.0, "the router's probes counting every turn"
    )
    served_now = served()
    assert len(served_now) == 2 and sum(served_now) == NUM_SESSIONS * NUM_TURNS
    assert max(served_now) <= 2 * min(served_now), f"unbalanced: {served_now}"
