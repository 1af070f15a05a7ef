"""The async lane between real processes (issue 52): background responses queued through one codec
process, run by drainer processes (`kvrelay codec --drain`) on the e2e stack's router and worker (the real
model), with a queue-role redis-server (append-only, fsync always) of the test's own. Through the official
openai SDK (strict, no retries):

- a response whose accepting codec is SIGKILLed mid-run still completes, and is read and streamed with
  `starting_after` through another codec, then another is cancelled there;
- a drainer SIGKILLed mid-run: another takes its jobs over, and every job ends completed, once;
- the queue's Redis SIGKILLed mid-run and started again on its append-only file: no job lost;
- a drainer SIGKILLed mid-batch (issue 53): the batch completes with every custom_id exactly once.
"""

from __future__ import annotations

import io
import json
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from services.common.cache_redis import start_queue_redis, stop_cache_redis
from tests.e2e.conftest import TOKEN, RunningStack, wait_http_ready
from tests.postgres import fresh_database
from tests.stack_helpers import Proc, free_port, stack_env
from tests.stack_helpers import wait_for as wait_within

pytestmark = pytest.mark.model

CLAIM_AFTER_MS = 2000  # a dead drainer's jobs are taken over this long after its last renewal
MAX_TOKENS = 24
TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
ENDED = {"completed", "incomplete", "failed", "cancelled"}
FINISHED = {"completed", "incomplete"}  # ran to its end (incomplete: it reached max_output_tokens)


@dataclass
class Lane:
    stack: RunningStack
    model_dir: Path
    logs: Path
    redis_port: int
    redis_dir: Path
    database: str = ""  # the batch store (PostgreSQL)
    redis: Any = None
    codecs: dict[str, tuple[Proc, str]] = field(default_factory=dict)

    def start_redis(self) -> None:
        self.redis = start_queue_redis(self.redis_port, str(self.redis_dir))

    def start_codec(self, name: str, *, drain: bool) -> str:
        port = free_port()
        env = stack_env(
            TOKEN,
            KVRELAY_QUEUE__URL=f"redis://127.0.0.1:{self.redis_port}/0",
            KVRELAY_QUEUE__CLAIM_AFTER_MS=str(CLAIM_AFTER_MS),
            KVRELAY_QUEUE__DRAIN_POLL_MS="50",
            KVRELAY_QUEUE__SOCKET_TIMEOUT_MS="500",
            KVRELAY_QUEUE__DRAIN_CONCURRENCY="2",
            KVRELAY_BATCHES__STORE_URL=self.database,
            KVRELAY_BATCHES__SWEEP_MS="200",
            KVRELAY_LIMITS__STEP_TIMEOUT_MS="20000",  # a loaded 2-core machine: what is tested is the lane
            KVRELAY_LIMITS__MAX_OUTPUT_TOKENS="100",  # (and 20 s × 100 fits the request timeout)
            KVRELAY_LIMITS__DEFAULT_MAX_OUTPUT_TOKENS="64",
        )
        args = ["codec", "--model", str(self.model_dir), "--router", self.stack.router_address]
        args += ["--port", str(port), "--grace-seconds", "5", *(["--drain"] if drain else [])]
        proc = Proc(args, env, self.logs / f"{name}.log")
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(url, proc)
        self.codecs[name] = (proc, url)
        return url

    def kill(self, name: str) -> None:
        proc, _ = self.codecs.pop(name)
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait()
        proc.stop()

    def client(self, name: str) -> openai.OpenAI:
        url = self.codecs[name][1]
        return openai.OpenAI(
            base_url=f"{url}/v1", api_key="open", max_retries=0, _strict_response_validation=True
        )


@pytest.fixture
def lane(stack: RunningStack, model_dir: Path, tmp_path: Path) -> Iterator[Lane]:
    made = Lane(stack, model_dir, tmp_path, free_port(), tmp_path / "redis")
    made.redis_dir.mkdir()
    made.start_redis()
    try:
        with fresh_database() as made.database:
            yield made
    finally:
        for proc, _ in made.codecs.values():
            proc.stop()
        if made.redis is not None:
            stop_cache_redis(made.redis)


def create(client: openai.OpenAI, n: int) -> list[str]:
    return [
        client.responses.create(
            model=_model(client), input=f"Count from {i} to {i + 20}, one number per line.",
            max_output_tokens=MAX_TOKENS, temperature=0, background=True,
        ).id
        for i in range(n)
    ]  # fmt: skip


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def statuses(client: openai.OpenAI, ids: list[str]) -> list[str]:
    out = []
    for response_id in ids:
        try:
            out.append(str(client.responses.retrieve(response_id).status))
        except (openai.APIConnectionError, openai.InternalServerError):
            out.append("unreadable")  # the queue's Redis is down a moment
    return out


def ended_once(client: openai.OpenAI, response_id: str) -> bool:
    """The response's kept events hold exactly one final event, and it says the run finished."""
    events = list(client.responses.retrieve(response_id, stream=True))
    finals = [e.type for e in events if e.type in TERMINAL]
    return finals in (["response.completed"], ["response.incomplete"])


def test_an_accepting_codec_killed_mid_run_and_reads_and_cancel_through_another(lane: Lane) -> None:
    lane.start_codec("accepting", drain=False)
    lane.start_codec("other", drain=False)
    lane.start_codec("drainer", drain=True)
    [response_id] = create(lane.client("accepting"), 1)
    other = lane.client("other")
    wait_for(lambda: statuses(other, [response_id]) != ["queued"], "never started")
    lane.kill("accepting")
    done = wait_for(lambda: (r := other.responses.retrieve(response_id)).completed_at and r, "never ended")
    assert (
        done.status in FINISHED
        and done.output_text
        and done.usage is not None
        and done.usage.output_tokens >= 1
    )
    events = list(other.responses.retrieve(response_id, stream=True, starting_after=3))
    assert events[0].sequence_number == 4 and events[-1].type == f"response.{done.status}"
    deltas = "".join(
        e.delta
        for e in other.responses.retrieve(response_id, stream=True)
        if e.type == "response.output_text.delta"
    )
    assert deltas == done.output_text
    [cancelled_id] = create(other, 1)
    assert other.responses.cancel(cancelled_id).status == "cancelled"
    final = wait_for(lambda: (r := other.responses.retrieve(cancelled_id)).completed_at and r, "never ended")
    assert final.status == "cancelled"


def test_a_drainer_killed_mid_run_loses_no_job_and_runs_none_twice_to_the_end(lane: Lane) -> None:
    lane.start_codec("accepting", drain=False)
    lane.start_codec("first-drainer", drain=True)
    client = lane.client("accepting")
    ids = create(client, 6)
    wait_for(lambda: "in_progress" in statuses(client, ids), "the first drainer never started one")
    lane.kill("first-drainer")
    running = statuses(client, ids).count("in_progress")
    lane.start_codec("second-drainer", drain=True)
    wait_for(lambda: set(statuses(client, ids)) <= ENDED, "not every job ended", 240)
    assert set(statuses(client, ids)) <= FINISHED
    assert running >= 1
    assert all(ended_once(client, response_id) for response_id in ids)


def test_the_queue_redis_killed_mid_run_and_restarted_loses_no_job(lane: Lane) -> None:
    lane.start_codec("accepting", drain=False)
    lane.start_codec("drainer", drain=True)
    client = lane.client("accepting")
    ids = create(client, 6)
    wait_for(lambda: "in_progress" in statuses(client, ids), "the drainer never started one")
    lane.redis.send_signal(signal.SIGKILL)  # no shutdown save: only the append-only file remains
    lane.redis.wait()
    with pytest.raises(openai.InternalServerError):  # background work is refused while it is down
        create(client, 1)
    reply = httpx.post(
        f"{lane.codecs['accepting'][1]}/v1/chat/completions",
        json={"model": _model(client), "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert reply.status_code == 200  # interactive requests never touch the queue
    lane.start_redis()
    wait_for(lambda: set(statuses(client, ids)) <= ENDED, "a job was lost with the Redis", 240)
    assert set(statuses(client, ids)) <= FINISHED
    assert all(ended_once(client, response_id) for response_id in ids)


def test_a_drainer_stopped_with_sigterm_finishes_or_gives_back_its_jobs(lane: Lane) -> None:
    """SIGTERM: it takes no more, its running jobs finish within the grace period or go back to the queue
    at once (no wait for claim_after), and the next drainer ends every one, once."""
    lane.start_codec("accepting", drain=False)
    lane.start_codec("first-drainer", drain=True)
    client = lane.client("accepting")
    ids = create(client, 6)
    wait_for(lambda: "in_progress" in statuses(client, ids), "the first drainer never started one")
    proc, _ = lane.codecs.pop("first-drainer")
    assert proc.stop() in (0, -signal.SIGTERM)  # a graceful exit (uvicorn re-raises the signal it caught)
    lane.start_codec("second-drainer", drain=True)
    wait_for(lambda: set(statuses(client, ids)) <= ENDED, "not every job ended", 240)
    assert set(statuses(client, ids)) <= FINISHED
    assert all(ended_once(client, response_id) for response_id in ids)


def test_a_drainer_killed_mid_batch_leaves_every_custom_id_answered_once(lane: Lane) -> None:
    lane.start_codec("accepting", drain=False)
    lane.start_codec("first-drainer", drain=True)
    client = lane.client("accepting")
    model = _model(client)
    lines = [
        json.dumps({
            "custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {
                "model": model, "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
                "max_tokens": MAX_TOKENS, "temperature": 0,
            },
        })
        for i in range(8)
    ]  # fmt: skip
    upload = client.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    counts = wait_for(
        lambda: (c := client.batches.retrieve(batch.id).request_counts) and c.completed >= 1 and c,
        "the first drainer never finished a line",
    )
    lane.kill("first-drainer")
    assert counts.completed < 8  # killed mid-batch
    lane.start_codec("second-drainer", drain=True)
    done = wait_for(
        lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, "never completed", 240
    )
    assert (
        done.request_counts is not None and done.request_counts.completed == 8 and done.error_file_id is None
    )
    assert done.output_file_id is not None
    output = [json.loads(line) for line in client.files.content(done.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in output) == sorted(f"line-{i}" for i in range(8))  # each once
    assert all(r["response"]["status_code"] == 200 for r in output)


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = 120.0) -> Any:
    return wait_within(condition, what, timeout_s)
