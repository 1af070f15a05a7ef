"""Files and Batches at the codec (protocols/openai_files.py, openai_batches.py, anthropic_batches.py,
lane/batches.py): the official openai and anthropic SDKs (strict, no retries) against two codec apps over
one fake backend, a real queue-role redis-server and a real PostgreSQL database: one app accepts, the
other drains. A batch runs to `completed` with every custom_id once in its files; bad lines become error
records; cancel keeps the finished lines; a short window expires a batch; another tenant's IDs are 404s;
every bad input is a clean 4xx in the protocol's shape."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from services.codec.admission.auth import KeyRecord, key_digest, new_key, write_keys_file
from services.codec.backend.protocol import ServiceStatus
from services.codec.text.tokenizer import Tokenizer
from services.common import priority
from services.common.cache_redis import start_queue_redis, stop_cache_redis
from services.common.config import AuthConfig, BatchesConfig, KvrelayConfig, QueueConfig
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, scripted, serve_in_thread
from tests.ports import free_port
from tests.postgres import fresh_database
from tests.stack_helpers import wait_for

pytestmark = pytest.mark.model

IDLE = [ServiceStatus("worker-0", "colocated", "127.0.0.1:1", True)]
BUSY = [ServiceStatus("worker-0", "colocated", "127.0.0.1:1", True, waiting=5)]
MAX_FILE_BYTES = 64 * 1024


@dataclass
class Stack:
    accepting: str
    draining: str
    fake: FakeBackend
    keys: dict[str, str]
    make_app: Callable[..., Any]

    def openai(self, url: str, who: str = "plain") -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{url}/v1", api_key=self.keys[who], max_retries=0, _strict_response_validation=True
        )

    def anthropic(self, url: str, who: str = "plain") -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=url, api_key=self.keys[who], max_retries=0, _strict_response_validation=True
        )


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    from services.codec.app import create_app

    tmp = tmp_path_factory.mktemp("batches")
    port = free_port()
    redis = start_queue_redis(port, str(tmp))
    keys, records = {}, []
    for name in ("plain", "other"):
        key_id, key = new_key()
        records.append(KeyRecord(key_id=key_id, tenant=name, sha256=key_digest(key)))
        keys[name] = key
    write_keys_file(tmp / "keys.yaml", records)
    tokenizer = Tokenizer.from_dir(model_dir)
    identity = identity_for(model_dir)
    fake = FakeBackend(identity.tokenizer_fingerprint, statuses_value=list(IDLE))
    with fresh_database() as database:

        def make_app(drain: bool = False, **batches: Any) -> Any:
            config = KvrelayConfig(
                auth=AuthConfig(keys_file=str(tmp / "keys.yaml")),
                queue=QueueConfig(
                    url=f"redis://127.0.0.1:{port}/0",
                    claim_after_ms=2000,
                    drain_poll_ms=50,
                    metrics_refresh_ms=100,
                ),
                batches=BatchesConfig(
                    store_url=database, max_file_bytes=MAX_FILE_BYTES, sweep_ms=100, **batches
                ),
            )
            return create_app(fake, tokenizer, config, identity, drain=drain, grace_s=2.0)

        with (
            serve_in_thread(make_app()) as accepting,
            serve_in_thread(make_app(drain=True)) as draining,
        ):
            yield Stack(accepting, draining, fake, keys, make_app)
    stop_cache_redis(redis)


@pytest.fixture(autouse=True)
def fresh(stack: Stack, model_dir: Path) -> None:
    stack.fake.reset()
    stack.fake.statuses_value = list(IDLE)
    stack.fake.script = scripted([Tokenizer.from_dir(model_dir).encode("Hello world")])


def chat_line(custom_id: str, model: str = MODEL_NAME, **extra: Any) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Say hi to {custom_id}."}],
        "max_tokens": 8,
    }
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {**body, **extra},
    }


def upload(client: openai.OpenAI, lines: list[Any]) -> str:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return client.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def ended(client: openai.OpenAI, batch_id: str, status: str = "completed") -> Any:
    return wait_for(
        lambda: (b := client.batches.retrieve(batch_id)).status == status and b, f"batch never {status}"
    )


def records(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def test_a_batch_runs_every_line_once_in_the_low_class(stack: Stack) -> None:
    client = stack.openai(stack.accepting)
    file_id = upload(client, [chat_line(f"req-{i}") for i in range(6)])
    meta = client.files.retrieve(file_id)
    assert meta.purpose == "batch" and meta.bytes > 0 and meta.expires_at is not None
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "a"}
    )
    assert batch.status == "in_progress" and batch.request_counts is not None
    assert batch.request_counts.total == 6 and batch.metadata == {"run": "a"}
    done = ended(stack.openai(stack.draining), batch.id)  # read from the other codec
    assert done.request_counts is not None and done.request_counts.completed == 6
    assert done.request_counts.failed == 0 and done.error_file_id is None and done.completed_at
    output = records(client, done.output_file_id)
    assert sorted(r["custom_id"] for r in output) == [f"req-{i}" for i in range(6)]  # each once
    for record in output:
        assert record["response"]["status_code"] == 200 and record["error"] is None
        body = record["response"]["body"]
        assert (
            body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "Hello world"
        )
    assert {r.priority for r in stack.fake.seen} == {priority.LOW}
    assert client.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in client.batches.list()]
    assert file_id in [f.id for f in client.files.list(purpose="batch")]
    assert client.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(file_id)
    lines = httpx.get(f"{stack.draining}/metrics").text
    assert re.search(r'^kvrelay_batch_lines_total\{outcome="succeeded"\} ([6-9]|\d\d)', lines, re.M)
    completed = re.compile(r'^kvrelay_batches\{status="completed"\} [1-9]', re.M)
    wait_for(  # read from the store: the accepting codec, which ran nothing, shows it too
        lambda: completed.search(httpx.get(f"{stack.accepting}/metrics").text),
        "the batch gauge never showed a completed batch",
    )


def test_bad_lines_become_error_records_and_the_batch_completes(stack: Stack) -> None:
    client = stack.openai(stack.accepting)
    lines = [
        chat_line("good-1"),
        "{not json",
        chat_line("wrong-model", model="some-other-model"),
        {**chat_line("wrong-url"), "url": "/v1/completions"},
        chat_line("streamed", stream=True),
        chat_line("too-long", max_tokens=10**9),  # refused by the route when it runs: a 400 record
        '{"custom_id": "nan", "url": "/v1/chat/completions", "body": {"temperature": NaN}}',
        json.dumps(chat_line("nul\x00")),  # PostgreSQL keeps no NUL character
        "[" * 200 + "]" * 200,
        "",  # blank: skipped, still counted as a line of the file
        chat_line("good-2"),
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint="/v1/chat/completions", completion_window="24h"
    )
    done = ended(client, batch.id)
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        10,
        2,
        8,
    )
    assert sorted(r["custom_id"] for r in records(client, done.output_file_id)) == ["good-1", "good-2"]
    errors = {r["custom_id"]: r for r in records(client, done.error_file_id)}
    refused = [r for r in records(client, done.error_file_id) if r["custom_id"] is None]
    assert [r["error"]["line"] for r in refused] == [2, 7, 8, 9]  # the file's own line numbers
    assert {r["error"]["code"] for r in refused} == {"invalid_json_line"}
    assert errors["wrong-model"]["error"]["code"] == "model_not_found"
    assert errors["wrong-url"]["error"]["code"] == "mismatched_endpoint"
    assert errors["streamed"]["error"]["code"] == "unsupported_parameter"
    too_long = errors["too-long"]["response"]
    assert too_long["status_code"] == 400 and too_long["body"]["error"]["type"] == "invalid_request_error"


def test_a_cancelled_batch_keeps_its_finished_lines(stack: Stack) -> None:
    stack.fake.delay_s = 0.3  # each line takes about a second
    client = stack.openai(stack.accepting)
    batch = client.batches.create(
        input_file_id=upload(client, [chat_line(f"c-{i}") for i in range(12)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 1, "no line finished")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = ended(client, batch.id, "cancelled")
    output = records(client, done.output_file_id)
    errors = records(client, done.error_file_id)
    assert len(output) >= 1 and all(r["response"]["status_code"] == 200 for r in output)
    assert {r["error"]["code"] for r in errors} == {"batch_cancelled"}
    ids = sorted(r["custom_id"] for r in output + errors)
    assert ids == sorted(f"c-{i}" for i in range(12))  # every line once: finished or cancelled
    assert done.request_counts is not None
    assert done.request_counts.completed == len(output) and done.request_counts.failed == len(errors)
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: unchanged


def test_a_batch_past_its_window_expires_with_its_lines_in_the_error_file(stack: Stack) -> None:
    stack.fake.statuses_value = list(BUSY)  # the pools look busy: no line starts
    with serve_in_thread(stack.make_app(completion_window_s=1)) as short:
        client = stack.openai(short)
        batch = client.batches.create(
            input_file_id=upload(client, [chat_line("late-1"), chat_line("late-2")]),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        )
        assert batch.expires_at is not None and batch.expires_at - batch.created_at == 1
        done = ended(client, batch.id, "expired")  # the drainer's sweep closes it
    client = stack.openai(stack.accepting)
    assert done.expired_at and done.output_file_id is None
    errors = records(client, done.error_file_id)
    assert sorted(r["custom_id"] for r in errors) == ["late-1", "late-2"]
    assert {r["error"]["code"] for r in errors} == {"batch_expired"}
    assert stack.fake.seen == []


def test_anthropic_message_batches_run_and_give_results(stack: Stack) -> None:
    client = stack.anthropic(stack.accepting)
    params = {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    batch = client.messages.batches.create(
        requests=[
            {"custom_id": "a-1", "params": params},  # type: ignore[typeddict-item]
            {"custom_id": "a-2", "params": {**params, "model": "not-served"}},  # type: ignore[typeddict-item]
            {"custom_id": "a-3", "params": params},  # type: ignore[typeddict-item]
            {"custom_id": "a-4", "params": {**params, "system": "nul\x00"}},  # type: ignore[typeddict-item]
        ]
    )
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 2
    done = wait_for(
        lambda: (b := client.messages.batches.retrieve(batch.id)).processing_status == "ended" and b,
        "never ended",
    )
    assert (done.request_counts.succeeded, done.request_counts.errored) == (2, 2) and done.ended_at
    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert set(results) == {"a-1", "a-2", "a-3", "a-4"} and results["a-4"].type == "errored"
    assert results["a-1"].type == "succeeded" and results["a-1"].message.content[0].text == "Hello world"  # type: ignore[union-attr]
    assert results["a-2"].type == "errored" and results["a-2"].error.error.type == "invalid_request_error"  # type: ignore[union-attr]
    assert batch.id in [b.id for b in client.messages.batches.list()]
    assert client.messages.batches.delete(batch.id).id == batch.id
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(batch.id)


def test_another_tenants_files_and_batches_are_404s(stack: Stack) -> None:
    mine, theirs = stack.openai(stack.accepting), stack.openai(stack.accepting, "other")
    file_id = upload(mine, [chat_line("x")])
    batch = mine.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    for call in (
        lambda: theirs.files.retrieve(file_id),
        lambda: theirs.files.content(file_id),
        lambda: theirs.files.delete(file_id),
        lambda: theirs.batches.retrieve(batch.id),
        lambda: theirs.batches.cancel(batch.id),
        lambda: theirs.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert file_id not in str(refused.value.body) or "No file" in str(refused.value.body)
    assert file_id not in [f.id for f in theirs.files.list()] and batch.id not in [
        b.id for b in theirs.batches.list()
    ]
    other_anthropic = stack.anthropic(stack.accepting, "other")
    with pytest.raises(anthropic.NotFoundError):
        other_anthropic.messages.batches.retrieve(batch.id)  # an OpenAI batch is no message batch either


def test_bad_requests_are_clean_errors(stack: Stack) -> None:
    client = stack.openai(stack.accepting)
    file_id = upload(client, [chat_line("a")])
    refusals = {
        "endpoint": lambda: client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/embeddings",  # type: ignore[arg-type]
            completion_window="24h",
        ),
        "completion_window": lambda: client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="1h",  # type: ignore[arg-type]
        ),
        "input_file_id": lambda: client.batches.create(  # a custom_id given twice
            input_file_id=upload(client, [chat_line("dup"), chat_line("dup")]),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        ),
        "purpose": lambda: client.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="assistants"),
    }
    for param, call in refusals.items():
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.body["param"] == param, (param, refused.value.body)  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("big.jsonl", io.BytesIO(b"x" * (MAX_FILE_BYTES + 1))), purpose="batch")
    assert too_big.value.status_code == 413
    empty = upload(client, ["", " "])
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=empty, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    plain = httpx.post(
        f"{stack.accepting}/v1/files",
        headers={"authorization": f"Bearer {stack.keys['plain']}"},
        json={"a": 1},
    )
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "file"
    anth = stack.anthropic(stack.accepting)
    params = {"model": MODEL_NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}
    with pytest.raises(anthropic.BadRequestError) as duplicate:
        anth.messages.batches.create(
            requests=[{"custom_id": "d", "params": params}, {"custom_id": "d", "params": params}]  # type: ignore[list-item]
        )
    assert duplicate.value.body["type"] == "error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        anth.messages.batches.create(requests=[])
    with pytest.raises(anthropic.BadRequestError):  # a custom_id is 1 to 64 of [a-zA-Z0-9_-], no newline
        anth.messages.batches.create(requests=[{"custom_id": "x\n", "params": params}])  # type: ignore[list-item]


def test_without_a_store_the_routes_say_how_to_configure_them(model_dir: Path) -> None:
    from services.codec.app import create_app

    identity = identity_for(model_dir)
    fake = FakeBackend(identity.tokenizer_fingerprint)
    app = create_app(fake, Tokenizer.from_dir(model_dir), KvrelayConfig(), identity)
    with serve_in_thread(app) as url:
        answer = httpx.get(f"{url}/v1/batches")
        assert answer.status_code == 400 and "batches.store_url" in answer.json()["error"]["message"]
        answer = httpx.get(f"{url}/v1/messages/batches")
        assert answer.status_code == 400 and answer.json()["type"] == "error"


def test_a_store_that_does_not_answer_is_a_503(stack: Stack, model_dir: Path) -> None:
    from services.codec.app import create_app

    config = KvrelayConfig(
        queue=QueueConfig(url=f"redis://127.0.0.1:{free_port()}/0"),
        batches=BatchesConfig(
            store_url=f"postgresql://postgres@127.0.0.1:{free_port()}/none", timeout_ms=500
        ),
    )
    app = create_app(stack.fake, Tokenizer.from_dir(model_dir), config, identity_for(model_dir))
    with serve_in_thread(app) as url:
        answer = httpx.get(f"{url}/v1/files")
        assert answer.status_code == 503 and answer.headers["retry-after"]
        assert answer.json()["error"]["code"] == "service_unavailable"
        answer = httpx.get(f"{url}/v1/messages/batches/msgbatch_x")
        assert answer.status_code == 503 and answer.json()["error"]["type"] == "overloaded_error"
