"""Background Responses at the codec (protocols/openai_responses_background.py, drainer.py): the official
openai SDK (strict, no retries) against two codec apps over one fake backend and a real queue-role
redis-server: one accepts, the other drains. Created `queued`, run by the drainer, retrieved and streamed
with `starting_after` from the other app, cancelled queued or running; the class kept, the caps (429),
the permission (400), and a queue that is down (503) while interactive requests still answer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from services.cli.status import format_queue
from services.codec.admission.auth import KeyRecord, key_digest, new_key, write_keys_file
from services.codec.backend.protocol import ServiceStatus
from services.codec.text.tokenizer import Tokenizer
from services.common import priority
from services.common.cache_redis import start_queue_redis, stop_cache_redis
from services.common.config import AuthConfig, KvrelayConfig, QueueConfig, QuotasConfig, TenantQuota
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, scripted, serve_in_thread
from tests.ports import free_port
from tests.stack_helpers import wait_for

pytestmark = pytest.mark.model

IDLE = [ServiceStatus("worker-0", "colocated", "127.0.0.1:1", True)]  # nothing waiting: drain
BUSY = [ServiceStatus("worker-0", "colocated", "127.0.0.1:1", True, waiting=5)]  # never drain


@dataclass
class Lane:
    accepting: str  # the codec a client creates on
    draining: str  # the codec whose drainer runs them (and which also answers reads)
    fake: FakeBackend
    keys: dict[str, str]

    def client(self, url: str, who: str = "plain") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{url}/v1", api_key=self.keys[who], max_retries=0, _strict_response_validation=True
        )


@pytest.fixture(scope="module")
def lane(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lane]:
    from services.codec.app import create_app

    tmp = tmp_path_factory.mktemp("lane")
    port = free_port()
    redis = start_queue_redis(port, str(tmp))
    keys, records = {}, []
    for name, allowed in (("plain", False), ("vip", True), ("capped", False), ("ops", False)):
        key_id, key = new_key()
        record = KeyRecord(
            key_id=key_id, tenant=name, sha256=key_digest(key), priority_tier=allowed, admin=name == "ops"
        )
        records.append(record)
        keys[name] = key
    write_keys_file(tmp / "keys.yaml", records)
    quotas = QuotasConfig(tenants={"capped": TenantQuota(max_queued_jobs=1)})
    config = KvrelayConfig(
        auth=AuthConfig(keys_file=str(tmp / "keys.yaml")),
        queue=QueueConfig(
            url=f"redis://127.0.0.1:{port}/0", claim_after_ms=2000, drain_poll_ms=50, metrics_refresh_ms=100
        ),
        quotas=quotas,
    )
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = FakeBackend(identity_for(model_dir).tokenizer_fingerprint, statuses_value=list(IDLE))
    identity = identity_for(model_dir)
    with (
        serve_in_thread(create_app(fake, tokenizer, config, identity)) as accepting,
        serve_in_thread(create_app(fake, tokenizer, config, identity, drain=True, grace_s=2.0)) as draining,
    ):
        yield Lane(accepting, draining, fake, keys)
    stop_cache_redis(redis)


@pytest.fixture(autouse=True)
def fresh(lane: Lane, model_dir: Path) -> None:
    lane.fake.reset()
    lane.fake.statuses_value = list(IDLE)
    lane.fake.script = scripted([Tokenizer.from_dir(model_dir).encode("Hello world")])


def pause_drainer(lane: Lane) -> None:
    """Make the pools look busy and wait until the drainer has seen it twice: from then on it takes
    nothing (a take it started on the idle view before has ended by the second look)."""
    lane.fake.statuses_value = list(BUSY)
    seen = lane.fake.status_reads
    wait_for(lambda: lane.fake.status_reads >= seen + 2, "the drainer never looked at the pools again")


def test_a_background_response_is_queued_then_run_and_read_from_the_other_codec(lane: Lane) -> None:
    created = lane.client(lane.accepting).responses.create(
        model=MODEL_NAME, input="Say hello.", max_output_tokens=8, background=True, service_tier="flex"
    )
    assert created.status == "queued" and created.background is True and created.service_tier == "flex"
    reader = lane.client(lane.draining)
    done = wait_for(
        lambda: (r := reader.responses.retrieve(created.id)).status == "completed" and r, "never completed"
    )
    assert done.output_text == "Hello world" and done.id == created.id and done.background is True
    assert done.usage is not None and done.usage.output_tokens == 3
    assert [r.priority for r in lane.fake.seen] == [priority.LOW]  # it ran in its class
    # the events again, from any codec, after a sequence number
    events = list(lane.client(lane.accepting).responses.retrieve(created.id, stream=True, starting_after=1))
    assert [e.sequence_number for e in events] == list(range(2, 2 + len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == "Hello world"
    everything = list(reader.responses.retrieve(created.id, stream=True))
    assert [e.type for e in everything[:3]] == ["response.queued", "response.created", "response.in_progress"]
    assert "".join(e.delta for e in everything if e.type == "response.output_text.delta") == "Hello world"
    reader.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):  # from either codec
        lane.client(lane.accepting).responses.retrieve(created.id)


def test_a_streamed_creation_follows_the_run(lane: Lane) -> None:
    stream = lane.client(lane.accepting).responses.create(
        model=MODEL_NAME, input="Say hello.", max_output_tokens=8, background=True, stream=True
    )
    events = list(stream)
    assert events[0].type == "response.queued" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_a_running_response_is_cancelled_and_its_generation_stops(lane: Lane) -> None:
    lane.fake.stall_before = 1  # one token, then nothing until the stream is closed
    client = lane.client(lane.accepting)
    created = client.responses.create(
        model=MODEL_NAME, input="Say hello.", max_output_tokens=8, background=True
    )
    wait_for(lambda: client.responses.retrieve(created.id).status == "in_progress", "never started")
    wait_for(lambda: lane.fake.seen, "never reached the backend")
    cancelled = client.responses.cancel(created.id)
    assert cancelled.status == "cancelled"
    wait_for(lambda: lane.fake.closed_early, "the generation was never aborted")
    final = wait_for(
        lambda: (r := client.responses.retrieve(created.id)).completed_at and r.status == "cancelled" and r,
        "not cancelled",
    )
    assert final.status == "cancelled"
    assert client.responses.cancel(created.id).status == "cancelled"  # again: unchanged
    events = list(client.responses.retrieve(created.id, stream=True))
    assert events and events[-1].type != "response.completed"  # the stream ends without completing


def test_a_queued_response_cancelled_never_runs(lane: Lane) -> None:
    pause_drainer(lane)  # the pools are busy: the drainer takes nothing
    client = lane.client(lane.accepting)
    created = client.responses.create(
        model=MODEL_NAME, input="Say hello.", max_output_tokens=8, background=True
    )
    assert client.responses.cancel(created.id).status == "cancelled"
    lane.fake.statuses_value = list(IDLE)
    other = client.responses.create(model=MODEL_NAME, input="Again.", max_output_tokens=8, background=True)
    wait_for(lambda: client.responses.retrieve(other.id).status == "completed", "the next one never ran")
    assert client.responses.retrieve(created.id).status == "cancelled"
    assert len(lane.fake.seen) == 1  # only the second reached the backend


def test_the_high_class_needs_the_permission_and_keeps_it_in_the_queue(lane: Lane) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        lane.client(lane.accepting).responses.create(
            model=MODEL_NAME, input="Hi", max_output_tokens=4, background=True, service_tier="priority"
        )
    assert refused.value.body["param"] == "service_tier"  # type: ignore[index]
    vip = lane.client(lane.accepting, "vip")
    created = vip.responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=4, background=True, service_tier="priority"
    )
    wait_for(lambda: vip.responses.retrieve(created.id).status == "completed", "never completed")
    assert [r.priority for r in lane.fake.seen] == [priority.HIGH]


def test_a_tenant_over_its_queue_cap_gets_a_429(lane: Lane) -> None:
    pause_drainer(lane)
    client = lane.client(lane.accepting, "capped")
    first = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, background=True)
    with pytest.raises(openai.RateLimitError) as full:
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, background=True)
    assert "queued" in full.value.message
    client.responses.cancel(first.id)
    lane.fake.statuses_value = list(IDLE)
    wait_for(lambda: _created(client), "the cap never freed after the cancelled job was retired")


def _created(client: openai.OpenAI) -> bool:
    try:
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, background=True)
    except openai.RateLimitError:
        return False
    return True


def test_another_tenants_response_is_a_404_and_store_false_is_a_400(lane: Lane) -> None:
    created = lane.client(lane.accepting).responses.create(
        model=MODEL_NAME, input="Hi", max_output_tokens=4, background=True
    )
    other = lane.client(lane.draining, "vip")
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.cancel(created.id)
    with pytest.raises(openai.BadRequestError) as unstored:
        other.responses.create(model=MODEL_NAME, input="Hi", background=True, store=False)
    assert unstored.value.body["param"] == "background"  # type: ignore[index]
    reply = httpx.get(
        f"{lane.accepting}/v1/responses/{created.id}",
        params={"stream": "true", "starting_after": "x"},
        headers={"authorization": f"Bearer {lane.keys['plain']}"},
    )
    assert reply.status_code == 400 and json.loads(reply.text)["error"]["param"] == "starting_after"


def test_a_queue_that_is_down_is_a_503_for_background_work_only(lane: Lane, model_dir: Path) -> None:
    from services.codec.app import create_app

    config = KvrelayConfig(queue=QueueConfig(url=f"redis://127.0.0.1:{free_port()}/0", socket_timeout_ms=500))
    app = create_app(lane.fake, Tokenizer.from_dir(model_dir), config, identity_for(model_dir))
    with serve_in_thread(app) as url:
        client = openai.OpenAI(
            base_url=f"{url}/v1", api_key="open", max_retries=0, _strict_response_validation=True
        )
        with pytest.raises(openai.InternalServerError) as down:
            client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, background=True)
        assert down.value.status_code == 503 and down.value.response.headers["retry-after"]
        with pytest.raises(openai.InternalServerError):  # not stored here: it may be a background one
            client.responses.retrieve("resp_" + "0" * 32)
        answer = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4)
        assert answer.status == "completed" and answer.output_text == "Hello world"
        assert client.responses.retrieve(answer.id).output_text == "Hello world"  # stored ones still read


def test_status_and_metrics_show_the_queue_by_class(lane: Lane) -> None:
    pause_drainer(lane)  # nothing drains: the jobs stay queued
    client = lane.client(lane.accepting)
    made = [
        client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, background=True, **tier)
        for tier in ({"service_tier": "flex"}, {"service_tier": "flex"}, {})
    ]
    ops = {"authorization": f"Bearer {lane.keys['ops']}"}
    document = httpx.get(f"{lane.draining}/status", headers=ops).json()
    classes = {c["class"]: c for c in document["queue"]["classes"]}
    assert document["queue"]["up"] and (classes["low"]["queued"], classes["normal"]["queued"]) == (2, 1)
    assert classes["high"]["queued"] == 0 and classes["low"]["oldest_age_s"] >= 0
    assert format_queue(document["queue"]).startswith("queue (queued/running): high 0/0, normal 1/0, low 2/0")

    def gauge() -> float | None:
        text = httpx.get(f"{lane.accepting}/metrics").text
        found = re.search(r'^kvrelay_queue_jobs\{class="low",state="queued"\} (\S+)$', text, re.M)
        return float(found.group(1)) if found else None

    wait_for(lambda: gauge() == 2.0, "the queue gauge never showed the low-class jobs")
    assert 'kvrelay_queue_jobs_created_total{class="low"}' in httpx.get(f"{lane.accepting}/metrics").text
    for response in made:
        client.responses.cancel(response.id)
    lane.fake.statuses_value = list(IDLE)
    wait_for(lambda: gauge() == 0.0, "the cancelled jobs were never retired")
    drained = httpx.get(f"{lane.draining}/metrics").text
    assert re.search(r'^kvrelay_queue_jobs_drained_total\{outcome="cancelled"\} [1-9]', drained, re.M)


def test_a_run_that_fails_ends_failed_with_its_error(lane: Lane) -> None:
    lane.fake.fail_after = 1  # the worker dies after one token
    client = lane.client(lane.accepting)
    created = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=8, background=True)
    final = wait_for(
        lambda: (r := client.responses.retrieve(created.id)).status not in ("queued", "in_progress") and r,
        "never ended",
    )
    assert final.status == "failed" and final.error is not None and final.error.code == "server_error"
    with pytest.raises(openai.APIError, match="generation failed"):  # as the live stream did: its error event
        list(client.responses.retrieve(created.id, stream=True))
    raw = httpx.get(
        f"{lane.draining}/v1/responses/{created.id}",
        params={"stream": "true"},
        headers={"authorization": f"Bearer {lane.keys['plain']}"},
    ).text
    types = [json.loads(line[6:])["type"] for line in raw.splitlines() if line.startswith("data: {")]
    assert types[-2:] == ["error", "response.failed"] and raw.endswith("data: [DONE]\n\n")
