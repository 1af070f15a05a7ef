"""The Redis primary killed under load, with Sentinel (issue 55, docs/deploy.md "Redis that survives a pod"):
a codec (also draining the async lane) in front of the running stack's router keeps quotas (database 0),
stored Responses (1) and the queue (2) on a Redis primary with one replica and a Sentinel of the test's own,
all through one `redis+sentinel://` URL. Chat requests run in a loop while the primary is SIGKILLed: none
fails (a quota call that meets the dead primary falls back to this replica's share, as documented), the
Sentinel promotes the replica, and after it quotas count on the new primary, a Response stored before the
kill reads back, a new one is stored, and a background response queued after the promotion runs to its end."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import TOKEN, RunningStack, wait_http_ready
from tests.redis_sentinel import SentinelSet
from tests.stack_helpers import Proc, free_port, stack_env, wait_until

pytestmark = pytest.mark.model

MODEL = "smollm2-135m-instruct"
DEADLINE_S = 30.0


@pytest.fixture
def ha(stack: RunningStack, model_dir: Path, tmp_path: Path) -> Iterator[tuple[SentinelSet, str]]:
    redis_set = SentinelSet(tmp_path / "redis").start()
    env = stack_env(
        TOKEN,
        KVRELAY_MODEL__DTYPE="float32",
        KVRELAY_QUOTAS__BACKEND="redis",
        KVRELAY_QUOTAS__REDIS_URL=f"{redis_set.url}/0",
        KVRELAY_QUOTAS__FAIL_OPEN="true",
        KVRELAY_QUOTAS__DEFAULT_REQUESTS_PER_MINUTE="100000",
        KVRELAY_RESPONSES__REDIS_URL=f"{redis_set.url}/1",
        KVRELAY_QUEUE__URL=f"{redis_set.url}/2",
        KVRELAY_QUEUE__DRAIN_POLL_MS="50",
        KVRELAY_QUEUE__SOCKET_TIMEOUT_MS="500",
    )
    port = free_port()
    args = ["codec", "--model", str(model_dir), "--router", stack.router_address]
    proc = Proc([*args, "--port", str(port), "--drain"], env, tmp_path / "codec.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ready(url, proc)
        yield redis_set, url
    finally:
        proc.stop()
        redis_set.stop()


def chat() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def respond(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": True, **extra}


def test_the_primary_killed_under_load_fails_over_and_state_resumes(ha: tuple[SentinelSet, str]) -> None:
    redis_set, url = ha
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=DEADLINE_S) as http:
            while not stop.is_set():
                statuses.append(http.post(f"{url}/v1/chat/completions", json=chat()).status_code)

    with httpx.Client(timeout=DEADLINE_S) as http:
        before = http.post(f"{url}/v1/responses", json=respond())
        assert before.status_code == 200, before.text
        stored_id = before.json()["id"]
        wait_until(lambda: redis_set._client(redis_set.replica_port).dbsize() > 0, 10, "replicated")
        loader = threading.Thread(target=load)
        loader.start()
        try:
            wait_until(lambda: len(statuses) >= 3, 60, "requests under way")
            redis_set.kill_primary()
            killed_at = len(statuses)
            wait_until(redis_set.promoted, 60, "the Sentinel promotes the replica")
            wait_until(lambda: len(statuses) >= killed_at + 5, 60, "requests after the promotion")
        finally:
            stop.set()
            loader.join(timeout=DEADLINE_S + 5)
        assert statuses and set(statuses) == {200}, statuses  # the fallback admitted the ones in between

        primary = redis_set.primary()

        def counted() -> bool:  # the quota store retries Redis after its back-off, then counts there
            http.post(f"{url}/v1/chat/completions", json=chat())
            return any(b"kvrelay-quota" in key for key in primary.scan_iter(count=1000))

        wait_until(counted, 30, "quotas counting on the new primary")
        assert http.get(f"{url}/v1/responses/{stored_id}").status_code == 200
        after = http.post(f"{url}/v1/responses", json=respond())
        assert (
            after.status_code == 200
            and http.get(f"{url}/v1/responses/{after.json()['id']}").status_code == 200
        )
        queued = http.post(f"{url}/v1/responses", json=respond(background=True))
        assert queued.status_code == 200, queued.text

        def finished() -> bool:
            status = http.get(f"{url}/v1/responses/{queued.json()['id']}").json().get("status")
            return status in ("completed", "incomplete")  # incomplete: its 2 tokens ran out

        wait_until(finished, 60, "the background response, queued on the new primary, runs to its end")
