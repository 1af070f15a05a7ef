"""Admission control through the codec app over a fake backend, with real API keys for two tenants:
429 per tenant, 503/529 when the queue is full, step timeouts, and everything given back afterwards."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from services.codec.admission.auth import KeyRecord, key_digest, new_key, write_keys_file
from services.codec.admission.quota_store import counter_name
from services.codec.grpc_public.server import PublicGrpcServer
from services.codec.state import CodecState
from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig
from services.common.tenants import cache_salt
from services.proto_gen.kvrelay.v1 import public_pb2 as pb
from services.proto_gen.kvrelay.v1 import public_pb2_grpc
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted, serve_in_thread

pytestmark = pytest.mark.model

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 8}
MESSAGES = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Count."}], "max_tokens": 8}


class Codec:
    """A codec app on a thread, with keys for tenants "a" and "b"."""

    def __init__(self, url: str, fake: FakeBackend, state: CodecState, keys: dict[str, str]) -> None:
        self.url = url
        self.fake = fake
        self.state = state
        self.keys = keys

    def client(self, tenant: str, timeout: float = 10.0) -> httpx.Client:
        headers = {"authorization": f"Bearer {self.keys[tenant]}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def metric(self, name: str, **labels: str) -> float:
        """A sample's value from /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics").text
        wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        pattern = re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)"
        found = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
        return float(found.group(1)) if found else 0.0

    def usage(self, counter: str) -> tuple[int, int]:
        return asyncio.run(self.state.gate.quotas.store.usage(counter))


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def start_codec(
    model_dir: Path, tokenizer: Tokenizer, keys_dir: Path, **sections: dict[str, Any]
) -> Iterator[Codec]:
    keys_file = keys_dir / "keys.yaml"
    records, keys = [], {}
    for tenant in ("a", "b"):
        key_id, key = new_key()
        records.append(KeyRecord(key_id=key_id, tenant=tenant, sha256=key_digest(key)))
        keys[tenant] = key
    write_keys_file(keys_file, records)
    config = KvrelayConfig.model_validate({**sections, "auth": {"keys_file": str(keys_file)}})
    identity = identity_for(model_dir)
    fake = FakeBackend(identity.tokenizer_fingerprint)
    fake.script = scripted([tokenizer.encode(" one two three four")])
    app = make_app(tokenizer, fake, identity, config)
    with serve_in_thread(app) as url:
        yield Codec(url, fake, app.state.codec, keys)


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def assert_all_given_back(codec: Codec) -> None:
    wait_for(lambda: codec.metric("kvrelay_admission_running") == 0)
    assert codec.metric("kvrelay_admission_queued") == 0
    assert codec.metric("kvrelay_quota_open_reservations") == 0
    assert codec.metric("kvrelay_quota_reserved_tokens") == 0


# --- quotas ---------------------------------------------------------------------------------------------


@pytest.fixture
def rpm_codec(model_dir: Path, tokenizer: Tokenizer, tmp_path: Path) -> Iterator[Codec]:
    yield from start_codec(model_dir, tokenizer, tmp_path, quotas={"default_requests_per_minute": 2})


def test_the_tenant_over_quota_gets_429_while_another_is_served(rpm_codec: Codec) -> None:
    with rpm_codec.client("a") as a, rpm_codec.client("b") as b:
        assert [a.post("/v1/chat/completions", json=CHAT).status_code for _ in range(2)] == [200, 200]
        refused = a.post("/v1/chat/completions", json=CHAT)
        assert refused.status_code == 429
        assert 1 <= int(refused.headers["retry-after"]) <= 120  # up to two windows, see quotas.py
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "requests"
        assert "tenant 'a'" in error["message"]
        anthropic = a.post("/v1/messages", json=MESSAGES)
        assert anthropic.status_code == 429 and "retry-after" in anthropic.headers
        assert anthropic.json()["error"]["type"] == "rate_limit_error"
        assert a.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}).status_code == 429
        responses = a.post("/v1/responses", json={"model": MODEL_NAME, "input": "x"})
        assert responses.status_code == 429
        # Tenant b has its own window and is served.
        assert [b.post("/v1/chat/completions", json=CHAT).status_code for _ in range(2)] == [200, 200]
    assert len(rpm_codec.fake.seen) == 4  # the refusals never reached the backend
    assert (
        rpm_codec.metric(
            "kvrelay_admission_rejections_total", tenant="a", reason="tenant_requests_per_minute"
        )
        == 4
    )
    assert_all_given_back(rpm_codec)


def test_the_cache_salt_is_the_authenticated_tenants(rpm_codec: Codec) -> None:
    with rpm_codec.client("a") as a, rpm_codec.client("b") as b:
        assert a.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert b.post("/v1/messages", json=MESSAGES).status_code == 200
    assert [r.cache_salt for r in rpm_codec.fake.seen] == [cache_salt("a"), cache_salt("b")]


def test_a_backend_that_is_down_gives_the_request_back(rpm_codec: Codec) -> None:
    rpm_codec.fake.is_unavailable = True
    with rpm_codec.client("a") as a:
        statuses = [a.post("/v1/chat/completions", json=CHAT).status_code for _ in range(3)]
        assert statuses == [503, 503, 503]
        rpm_codec.fake.is_unavailable = False
        assert [a.post("/v1/chat/completions", json=CHAT).status_code for _ in range(2)] == [200, 200]
    assert_all_given_back(rpm_codec)


@pytest.fixture
def tpm_codec(model_dir: Path, tokenizer: Tokenizer, tmp_path: Path) -> Iterator[Codec]:
    yield from start_codec(model_dir, tokenizer, tmp_path, quotas={"default_tokens_per_minute": 100_000})


def test_tokens_are_reserved_for_max_output_then_settled_to_what_was_used(
    tpm_codec: Codec, tokenizer: Tokenizer
) -> None:
    counter = counter_name("tenant", "tokens", "a")
    with tpm_codec.client("a") as a:
        body = a.post("/v1/chat/completions", json={**CHAT, "max_tokens": 500}).json()
    usage = body["usage"]
    generated = len(tokenizer.encode(" one two three four")) + 1  # and EOS
    assert usage["completion_tokens"] == generated - 1 or usage["completion_tokens"] == generated
    assert tpm_codec.usage(counter)[0] == usage["prompt_tokens"] + generated
    with tpm_codec.client("a") as a:  # no max_tokens: limits.default_max_output_tokens is reserved
        a.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "x"})
    assert_all_given_back(tpm_codec)


def test_an_encoder_decoder_request_is_charged_its_source(tpm_codec: Codec, tokenizer: Tokenizer) -> None:
    """The encoder reads the prompt: the tokens settled count it with the decoder's, as usage does."""
    tpm_codec.fake.encoder_decoder = True
    counter = counter_name("tenant", "tokens", "a")
    prompt = "translate: the tide comes in twice a day"
    with tpm_codec.client("a") as a:
        body = a.post(
            "/v1/completions", json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 50}
        ).json()
    source = tokenizer.encode(prompt, add_special_tokens=True)
    assert body["usage"]["prompt_tokens"] == len(source) + 1  # and the decoder's start token
    generated = len(tokenizer.encode(" one two three four")) + 1  # and EOS
    assert tpm_codec.usage(counter)[0] == body["usage"]["prompt_tokens"] + generated
    assert_all_given_back(tpm_codec)


def test_a_client_that_leaves_mid_stream_returns_budget_and_slot(tpm_codec: Codec) -> None:
    tpm_codec.fake.delay_s = 0.2
    tpm_codec.fake.script = scripted([[7] * 200])
    counter = counter_name("tenant", "tokens", "a")
    with (
        tpm_codec.client("a") as a,
        a.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 400, "stream": True}) as r,
    ):
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert tpm_codec.metric("kvrelay_quota_reserved_tokens") > 400
        assert tpm_codec.metric("kvrelay_admission_running") == 1
    wait_for(lambda: len(tpm_codec.fake.closed_early) == 1)
    assert_all_given_back(tpm_codec)
    used = tpm_codec.usage(counter)[0]
    assert 0 < used < 100  # settled to the prompt and the few tokens generated, not the 400 reserved


# --- saturation -----------------------------------------------------------------------------------------


@pytest.fixture
def tiny_codec(model_dir: Path, tokenizer: Tokenizer, tmp_path: Path) -> Iterator[Codec]:
    yield from start_codec(model_dir, tokenizer, tmp_path, limits={"concurrency_limit": 1, "queue_limit": 1})


def test_a_full_queue_is_503_and_529_on_anthropic(tiny_codec: Codec) -> None:
    tiny_codec.fake.delay_s = 0.05
    tiny_codec.fake.script = scripted([[7] * 100])
    queued: list[int] = []
    with (
        tiny_codec.client("a") as a,
        a.stream("POST", "/v1/chat/completions", json={**CHAT, "max_tokens": 100, "stream": True}) as held,
    ):
        lines = held.iter_lines()  # kept: a collected line iterator closes the stream
        assert next(lines).startswith("data: ")

        def second() -> None:
            with tiny_codec.client("b") as b:
                queued.append(b.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code)

        waiter = threading.Thread(target=second)
        waiter.start()
        wait_for(lambda: tiny_codec.metric("kvrelay_admission_queued") == 1)
        with tiny_codec.client("a") as again:
            openai_refusal = again.post("/v1/chat/completions", json=CHAT)
            anthropic_refusal = again.post("/v1/messages", json=MESSAGES)
    assert openai_refusal.status_code == 503 and openai_refusal.headers["retry-after"] == "1"
    assert openai_refusal.json()["error"]["code"] == "overloaded"
    assert anthropic_refusal.status_code == 529 and anthropic_refusal.headers["retry-after"] == "1"
    assert anthropic_refusal.json()["error"]["type"] == "overloaded_error"
    waiter.join(timeout=10)
    assert queued == [200]  # it got the slot once the first stream closed
    assert tiny_codec.metric("kvrelay_admission_rejections_total", tenant="a", reason="queue_full") == 2
    assert_all_given_back(tiny_codec)


# --- step timeout ---------------------------------------------------------------------------------------


@pytest.fixture
def slow_codec(model_dir: Path, tokenizer: Tokenizer, tmp_path: Path) -> Iterator[Codec]:
    yield from start_codec(
        model_dir,
        tokenizer,
        tmp_path,
        limits={"step_timeout_ms": 150},
        quotas={"default_tokens_per_minute": 10**6},
    )


@pytest.mark.parametrize("stream", [False, True])
def test_a_step_longer_than_the_timeout_aborts_the_request(slow_codec: Codec, stream: bool) -> None:
    slow_codec.fake.delay_s = 0.4  # the first token may take long; each next one may not
    with slow_codec.client("a") as a:
        response = a.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    if stream:
        assert response.status_code == 200
        events = [line for line in response.text.splitlines() if line.startswith("data: {")]
        assert '"error"' in events[-1]
    else:
        assert response.status_code == 500
        assert "generation failed" in response.json()["error"]["message"]
    wait_for(lambda: len(slow_codec.fake.closed_early) == 1)
    assert slow_codec.metric("kvrelay_step_timeouts_total") == 1
    assert_all_given_back(slow_codec)


@pytest.fixture
def encoder_codec(model_dir: Path, tokenizer: Tokenizer, tmp_path: Path) -> Iterator[Codec]:
    """An encoder-decoder model behind the codec, whose first token may take 150 ms at most."""
    for codec in start_codec(
        model_dir,
        tokenizer,
        tmp_path,
        limits={"encoder_timeout_ms": 150},
        quotas={"default_tokens_per_minute": 10**6},
    ):
        codec.fake.encoder_decoder = True
        yield codec


@pytest.mark.parametrize("stream", [False, True])
def test_a_first_token_later_than_the_encoder_timeout_is_a_504(encoder_codec: Codec, stream: bool) -> None:
    encoder_codec.fake.stall_before = 0  # the encoder never finishes
    body = {"model": CHAT["model"], "prompt": "translate: tide", "max_tokens": 4, "stream": stream}
    with encoder_codec.client("a") as a:
        response = a.post("/v1/completions", json=body)
    assert response.status_code == 504, response.text  # before any byte, streamed or not
    assert "limits.encoder_timeout_ms" in response.json()["error"]["message"]
    [seen] = encoder_codec.fake.seen
    assert seen.encoder_token_ids and seen.prompt_token_ids == [0]  # the prompt went to the encoder
    wait_for(lambda: encoder_codec.fake.closed_early == [seen.request_id])  # aborted behind the codec
    assert encoder_codec.metric("kvrelay_step_timeouts_total") == 0  # the encoder's, not a step's
    assert encoder_codec.metric("kvrelay_encoder_timeouts_total") == 1
    assert_all_given_back(encoder_codec)


def test_an_encoder_decoder_request_drops_its_cache_breakpoints(encoder_codec: Codec) -> None:
    """Breakpoints mark the rendered prompt, which is the source here: its KV is the request's own."""
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    body = {**MESSAGES, "system": system}
    with encoder_codec.client("a") as a:
        reply = a.post("/v1/messages", json=body)
    assert reply.status_code == 200, reply.text
    [seen] = encoder_codec.fake.seen
    assert seen.encoder_token_ids and seen.cache_breakpoints == ()
    assert reply.json()["usage"]["cache_creation_input_tokens"] == 0


def test_a_decoder_only_first_token_is_bounded_by_the_request_timeout_only(encoder_codec: Codec) -> None:
    """The encoder timeout is for encoder-decoder requests: a decoder-only model's slow first token is
    waited for."""
    encoder_codec.fake.encoder_decoder = False
    encoder_codec.fake.delay_s = 0.3  # twice the encoder timeout, per token
    with encoder_codec.client("a") as a:
        response = a.post("/v1/completions", json={"model": CHAT["model"], "prompt": "tide", "max_tokens": 1})
    assert response.status_code == 200, response.text


PATIENT_STEP_TIMEOUT_MS = 1000
NUM_PATIENT_STEPS = 12  # of 100 ms each: the whole request takes longer than one step timeout


@pytest.fixture
def patient_codec(model_dir: Path, tokenizer: Tokenizer, tmp_path: Path) -> Iterator[Codec]:
    """A step timeout ten times each step: a loaded machine does not push a step past it."""
    yield from start_codec(
        model_dir,
        tokenizer,
        tmp_path,
        limits={"step_timeout_ms": PATIENT_STEP_TIMEOUT_MS},
        quotas={"default_tokens_per_minute": 10**6},
    )


def test_steps_within_the_timeout_are_fine_however_long_the_request(
    patient_codec: Codec, tokenizer: Tokenizer
) -> None:
    """The timeout is per step, not per request: steps well within it add up to more than it."""
    patient_codec.fake.script = scripted([tokenizer.encode(" one" * (NUM_PATIENT_STEPS - 1))])
    patient_codec.fake.delay_s = PATIENT_STEP_TIMEOUT_MS / 1000 / 10
    started = time.monotonic()
    with patient_codec.client("b") as b:
        response = b.post("/v1/chat/completions", json={**CHAT, "max_tokens": NUM_PATIENT_STEPS + 4})
    assert time.monotonic() - started >= PATIENT_STEP_TIMEOUT_MS / 1000  # longer than one step timeout
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (
        " one" * (NUM_PATIENT_STEPS - 1),
        "stop",
    )
    assert patient_codec.fake.completed == [patient_codec.fake.seen[0].request_id]
    assert patient_codec.metric("kvrelay_step_timeouts_total") == 0


# --- public gRPC ----------------------------------------------------------------------------------------


async def test_grpc_over_quota_is_resource_exhausted_with_retry_after(
    model_dir: Path, tokenizer: Tokenizer
) -> None:
    identity = identity_for(model_dir)
    fake = FakeBackend(identity.tokenizer_fingerprint)
    fake.script = scripted([tokenizer.encode(" one")])
    config = KvrelayConfig.model_validate({"quotas": {"default_requests_per_minute": 1}})
    state = CodecState.build(fake, tokenizer, config, identity)
    server = PublicGrpcServer("127.0.0.1", 0, grace_s=5.0)
    request = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Hi")])
    async with server.serving(state), grpc.aio.insecure_channel(server.address) as channel:
        stub = public_pb2_grpc.InferenceStub(channel)
        assert [m async for m in stub.Chat(request)]
        call = stub.Chat(request)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [m async for m in call]
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    trailing = dict(caught.value.trailing_metadata() or ())
    assert 1 <= int(trailing["retry-after"]) <= 120
    assert len(fake.seen) == 1
    await state.aclose()
