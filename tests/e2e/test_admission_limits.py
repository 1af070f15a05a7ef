"""Admission limits on the real stack (worker, router, codec processes; API keys made by `kvrelay keys add`):

- a tenant over its requests-per-minute quota gets 429 with Retry-After while another is served;
- a full fair queue is 503 (OpenAI routes) and 529 overloaded_error (Anthropic's), with Retry-After;
- an oversized body is 413 and a context overflow a 400 that no worker ever sees;
- afterwards no slot, queued request, quota reservation, worker request or KV block is left over;
- two codec processes sharing the real Redis admit one quota together, give or take one request.
"""

from __future__ import annotations

import asyncio
import subprocess
import threading
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from tests.e2e.conftest import TOKEN, RunningStack, start_stack, wait_http_ready, worker_load
from tests.stack_helpers import KVRELAY, REPO_ROOT, Proc, free_port, stack_env, wait_until

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
RPM = 3  # every tenant's (quotas.default_requests_per_minute)
MAX_BODY_BYTES = 65536
MAX_INPUT_TOKENS = 128
SHARED_RPM = 10
REDIS_URL = "redis://127.0.0.1:6379/0"
TENANTS = ("alice", "bob", "carol", "dave", "erin")


def chat(max_tokens: int = 2, *, stream: bool = False, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def add_key(keys_file: Path, tenant: str) -> str:
    done = subprocess.run(
        [*KVRELAY, "keys", "add", "--tenant", tenant, "--file", str(keys_file)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


class Limited:
    def __init__(self, stack: RunningStack, keys: dict[str, str]) -> None:
        self.stack = stack
        self.keys = keys

    def client(self, tenant: str, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(
            base_url=self.stack.base_url,
            headers={"authorization": f"Bearer {self.keys[tenant]}"},
            timeout=timeout,
        )

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.stack.base_url}/metrics").text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        return 0.0


@pytest.fixture(scope="module")
def limited(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Limited]:
    keys_file = tmp_path_factory.mktemp("admission-keys") / "keys.yaml"
    keys = {tenant: add_key(keys_file, tenant) for tenant in TENANTS}
    running = start_stack(
        model_dir,
        tmp_path_factory.mktemp("admission-logs"),
        KVRELAY_AUTH__KEYS_FILE=str(keys_file),
        KVRELAY_QUOTAS__DEFAULT_REQUESTS_PER_MINUTE=str(RPM),
        KVRELAY_LIMITS__CONCURRENCY_LIMIT="1",
        KVRELAY_LIMITS__QUEUE_LIMIT="1",
        KVRELAY_LIMITS__MAX_BODY_BYTES=str(MAX_BODY_BYTES),
        KVRELAY_LIMITS__MAX_INPUT_TOKENS=str(MAX_INPUT_TOKENS),
    )
    yield Limited(running, keys)
    for proc in reversed(running.procs):
        proc.stop()


def assert_nothing_left(limited: Limited) -> None:
    def drained() -> bool:
        load = worker_load(limited.stack)
        return load.running == 0 and load.waiting == 0 and load.kv_blocks.active == 0

    wait_until(drained, 30.0, "the worker drained")
    wait_until(lambda: limited.metric("kvrelay_admission_running") == 0, 30.0, "every admission slot freed")
    assert limited.metric("kvrelay_admission_queued") == 0
    assert limited.metric("kvrelay_quota_open_reservations") == 0
    assert limited.metric("kvrelay_quota_reserved_tokens") == 0


def test_429_for_the_tenant_over_quota_while_another_is_served(limited: Limited) -> None:
    with limited.client("alice") as alice, limited.client("bob") as bob:
        for _ in range(RPM):
            assert alice.post("/v1/chat/completions", json=chat()).status_code == 200
        refused = alice.post("/v1/chat/completions", json=chat())
        assert refused.status_code == 429, refused.text
        assert 1 <= int(refused.headers["retry-after"]) <= 120
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
        anthropic = alice.post("/v1/messages", json=chat())
        assert anthropic.status_code == 429 and "retry-after" in anthropic.headers
        assert anthropic.json()["error"]["type"] == "rate_limit_error"
        served = bob.post("/v1/chat/completions", json=chat())
        assert served.status_code == 200, served.text
    assert_nothing_left(limited)


def test_503_and_529_when_the_queue_is_full(limited: Limited) -> None:
    """One slot (bob's stream) and one queue place (carol): dave is refused on both protocols."""
    results: dict[str, int] = {}
    body = chat(300, stream=True, ignore_eos=True, temperature=0)
    with (
        limited.client("bob") as bob,
        bob.stream("POST", "/v1/chat/completions", json=body) as held,
    ):
        lines = held.iter_lines()  # kept: a collected line iterator closes the stream
        assert next(lines).startswith("data: ")

        def queued() -> None:
            with limited.client("carol") as carol:
                results["carol"] = carol.post("/v1/chat/completions", json=chat()).status_code

        waiter = threading.Thread(target=queued)
        waiter.start()
        wait_until(lambda: limited.metric("kvrelay_admission_queued") == 1, 10.0, "one request queued")
        with limited.client("dave") as dave:
            openai_refusal = dave.post("/v1/chat/completions", json=chat())
            anthropic_refusal = dave.post("/v1/messages", json=chat())
    # bob's stream is closed here: its request is aborted and carol's gets the slot
    waiter.join(timeout=60)
    assert openai_refusal.status_code == 503 and openai_refusal.headers["retry-after"] == "1"
    assert openai_refusal.json()["error"]["code"] == "overloaded"
    assert anthropic_refusal.status_code == 529 and anthropic_refusal.headers["retry-after"] == "1"
    assert anthropic_refusal.json()["error"]["type"] == "overloaded_error"
    assert results == {"carol": 200}
    assert_nothing_left(limited)
    with limited.client("dave") as dave:  # the refusals gave dave's quota back
        assert [dave.post("/v1/chat/completions", json=chat()).status_code for _ in range(RPM)] == [200] * RPM


def test_413_for_a_body_over_the_limit(limited: Limited) -> None:
    big = chat(content_padding="x" * (MAX_BODY_BYTES + 1))
    with limited.client("bob") as bob:
        response = bob.post("/v1/chat/completions", json=big)
    assert response.status_code == 413


def test_400_for_a_context_overflow_before_any_worker_sees_it(limited: Limited) -> None:
    before = worker_load(limited.stack).requests_total
    long_prompt = {"role": "user", "content": "word " * (MAX_INPUT_TOKENS * 2)}
    # erin's own quota: a refused request still counts against it (charged before its body is read)
    with limited.client("erin") as erin:
        response = erin.post("/v1/chat/completions", json={**chat(), "messages": [long_prompt]})
        anthropic = erin.post("/v1/messages", json={**chat(), "messages": [long_prompt]})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert anthropic.status_code == 400 and anthropic.json()["error"]["type"] == "invalid_request_error"
    assert worker_load(limited.stack).requests_total == before
    assert_nothing_left(limited)


# --- two codecs, one Redis ------------------------------------------------------------------------------


async def _flush(prefix: str) -> None:
    client = aioredis.Redis.from_url(REDIS_URL)
    try:
        keys = [key async for key in client.scan_iter(match=f"{prefix}*")]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


def test_two_codecs_sharing_redis_admit_the_quota_together(limited: Limited, tmp_path: Path) -> None:
    prefix = f"{{e2e-quota-{uuid.uuid4().hex}}}:"
    env = stack_env(
        TOKEN,
        KVRELAY_MODEL__DTYPE="float32",
        KVRELAY_QUOTAS__BACKEND="redis",
        KVRELAY_QUOTAS__REDIS_URL=REDIS_URL,
        KVRELAY_QUOTAS__FAIL_OPEN="false",
        KVRELAY_QUOTAS__DEFAULT_REQUESTS_PER_MINUTE=str(SHARED_RPM),
        KVRELAY_QUOTAS_KEY_PREFIX=prefix,
    )
    model_dir = str(REPO_ROOT / "models" / MODEL)
    codecs: list[tuple[str, Proc]] = []
    try:
        for i in range(2):
            port = free_port()
            args = [
                "codec",
                "--model",
                model_dir,
                "--router",
                limited.stack.router_address,
                "--port",
                str(port),
            ]
            codecs.append((f"http://127.0.0.1:{port}", Proc(args, env, tmp_path / f"codec{i}.log")))
        for url, proc in codecs:
            wait_http_ready(url, proc)

        def send(i: int) -> int:
            url = codecs[i % 2][0]
            return httpx.post(f"{url}/v1/chat/completions", json=chat(1), timeout=60).status_code

        with ThreadPoolExecutor(max_workers=6) as pool:
            statuses = list(pool.map(send, range(3 * SHARED_RPM)))
        admitted = statuses.count(200)
        assert set(statuses) <= {200, 429}, statuses
        assert abs(admitted - SHARED_RPM) <= 1, statuses
        assert statuses.count(429) == len(statuses) - admitted
    finally:
        for _, proc in codecs:
            proc.stop()
        asyncio.run(_flush(prefix))
