"""Session keys (services/codec/session.py): the pure rules, then the key the backend sees per route."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from services.codec.grpc_public.server import PublicGrpcServer
from services.codec.session import (
    KEY_HEX_DIGITS,
    SESSION_HEADER,
    SessionSource,
    first_user_text,
    opaque_key,
    session_key,
)
from services.codec.state import CodecState
from services.codec.text.tokenizer import Tokenizer
from services.common.tenants import open_tenant
from services.proto_gen.kvrelay.v1 import public_pb2 as pb
from services.proto_gen.kvrelay.v1 import public_pb2_grpc
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, make_config, scripted

SYSTEM = {"role": "system", "content": "You are a helpful assistant shared by every session."}
PARIS = {"role": "user", "content": "What is the capital of France?"}
ROME = {"role": "user", "content": "What is the capital of Italy?"}
HEX = set("0123456789abcdef")


def turn_key(text: str, model: str = MODEL_NAME) -> str:
    return opaque_key(SessionSource.FIRST_USER_TURN, model, text)


def routed(key: str) -> str:
    """The key as a route sends it: scoped to the request's tenant (here the open-mode one)."""
    return opaque_key(SessionSource.TENANT, open_tenant().tenant_id, key)


# --- the pure rules ---------------------------------------------------------------------------------


def test_header_beats_client_key_beats_first_user_turn() -> None:
    messages = [SYSTEM, PARIS]
    client = (SessionSource.PROMPT_CACHE_KEY, "cache-7")
    everything = session_key(header="sess-1", client_key=client, model=MODEL_NAME, messages=messages)
    assert everything == opaque_key(SessionSource.HEADER, "sess-1")
    no_header = session_key(client_key=client, model=MODEL_NAME, messages=messages)
    assert no_header == opaque_key(SessionSource.PROMPT_CACHE_KEY, "cache-7")
    turn_only = session_key(model=MODEL_NAME, messages=messages)
    assert turn_only == turn_key(PARIS["content"])
    assert len({everything, no_header, turn_only}) == 3


def test_empty_values_count_as_absent() -> None:
    key = session_key(
        header="", client_key=(SessionSource.PROMPT_CACHE_KEY, ""), model=MODEL_NAME, messages=[PARIS]
    )
    assert key == turn_key(PARIS["content"])
    assert session_key(client_key=(SessionSource.ANTHROPIC_USER_ID, None), messages=[PARIS], model="m") == (
        turn_key(PARIS["content"], "m")
    )


def test_a_shared_system_prompt_never_keys_the_session() -> None:
    paris = session_key(model=MODEL_NAME, messages=[SYSTEM, PARIS])
    rome = session_key(model=MODEL_NAME, messages=[SYSTEM, ROME])
    assert paris != rome
    assert session_key(model=MODEL_NAME, messages=[SYSTEM, PARIS]) == paris
    other_system = {"role": "system", "content": "Answer in French."}
    assert session_key(model=MODEL_NAME, messages=[other_system, PARIS]) == paris
    assert session_key(model=MODEL_NAME, messages=[PARIS]) == paris
    assert session_key(model=MODEL_NAME, messages=[SYSTEM]) == ""  # the system prompt alone: none


def test_later_turns_and_a_greeting_before_the_first_user_turn_keep_the_key() -> None:
    first = session_key(model=MODEL_NAME, messages=[SYSTEM, PARIS])
    greeting = {"role": "assistant", "content": "Hello! How can I help?"}
    assert session_key(model=MODEL_NAME, messages=[SYSTEM, greeting, PARIS]) == first
    reply = {"role": "assistant", "content": "Paris."}
    assert session_key(model=MODEL_NAME, messages=[SYSTEM, PARIS, reply, ROME]) == first


def test_no_user_text_and_a_plain_prompt_give_no_key() -> None:
    assert session_key() == ""  # legacy Completions: no header, no turns
    assert session_key(model=MODEL_NAME, messages=[{"role": "assistant", "content": "Hi"}]) == ""
    assert session_key(model=MODEL_NAME, messages=[{"role": "user", "content": " \n"}]) == ""
    assert session_key(header="sess-1") == opaque_key(SessionSource.HEADER, "sess-1")


def test_the_model_name_and_the_source_are_part_of_the_key() -> None:
    assert turn_key("hi", "model-a") != turn_key("hi", "model-b")
    assert opaque_key(SessionSource.HEADER, "a") != opaque_key(SessionSource.PROMPT_CACHE_KEY, "a")
    assert opaque_key(SessionSource.PROMPT_CACHE_KEY, "a") != opaque_key(SessionSource.ANTHROPIC_USER_ID, "a")
    # Length-prefixed parts: moving a boundary changes the key.
    assert turn_key("bc", "a") != turn_key("c", "ab")


def test_keys_are_opaque_fixed_size_hex() -> None:
    secret = "my social security number is 123-45-6789"
    long_a, long_b = "x" * 10_000 + "a", "x" * 10_000 + "b"
    keys = [
        session_key(header=secret),
        session_key(header=long_a),
        session_key(header=long_b),
        session_key(model=MODEL_NAME, messages=[{"role": "user", "content": secret}]),
        session_key(model=MODEL_NAME, messages=[{"role": "user", "content": "lone \ud800 surrogate"}]),
    ]
    for key in keys:
        assert len(key) == KEY_HEX_DIGITS and set(key) <= HEX
    assert keys[1] != keys[2]  # hashed whole, never truncated


def test_the_derivation_is_pinned() -> None:
    """Routers and codecs of one deployment must agree: the derivation changes only with its version."""
    digest = hashlib.sha256()
    for part in (b"kvrelay-session/v1", b"x-session-id", b"sess-1"):
        digest.update(len(part).to_bytes(8, "big") + part)
    assert session_key(header="sess-1") == digest.hexdigest()[:32]


def test_first_user_text() -> None:
    assert first_user_text([SYSTEM, PARIS, ROME]) == PARIS["content"]
    assert first_user_text([SYSTEM]) is None


# --- through the app and the public gRPC API, over a fake backend ------------------------------------


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path) -> FakeBackend:
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    backend.script = scripted([[19556]])
    return backend


@pytest.fixture
async def client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(tokenizer, fake, identity_for(model_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


async def post_key(
    client: httpx.AsyncClient, fake: FakeBackend, path: str, body: dict[str, Any], **headers: str
) -> tuple[str, dict[str, Any]]:
    """The session key the backend saw for one request, and the response body."""
    before = len(fake.seen)
    response = await client.post(path, json=body, headers=headers)
    assert response.status_code == 200, response.text
    assert len(fake.seen) == before + 1
    return fake.seen[-1].session_key, response.json()


def chat(*messages: dict[str, Any], **fields: Any) -> dict[str, Any]:
    """A Chat Completions or Anthropic Messages body."""
    return {"model": MODEL_NAME, "messages": list(messages), "max_tokens": 4, **fields}


@pytest.mark.model
async def test_chat_completions_send_the_key(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    url = "/v1/chat/completions"
    key, _ = await post_key(client, fake, url, chat(SYSTEM, PARIS), **{SESSION_HEADER: "sess-1"})
    assert key == routed(opaque_key(SessionSource.HEADER, "sess-1"))
    key, _ = await post_key(client, fake, url, chat(SYSTEM, PARIS, prompt_cache_key="conv-9"))
    assert key == routed(opaque_key(SessionSource.PROMPT_CACHE_KEY, "conv-9"))
    paris, _ = await post_key(client, fake, url, chat(SYSTEM, PARIS))
    rome, _ = await post_key(client, fake, url, chat(SYSTEM, ROME))
    assert (
        paris == routed(turn_key(PARIS["content"]))
        and rome == routed(turn_key(ROME["content"]))
        and paris != rome
    )
    parts = {"role": "user", "content": [{"type": "text", "text": PARIS["content"]}]}
    developer = {"role": "developer", "content": "Be terse."}
    again, _ = await post_key(client, fake, url, chat(developer, parts))
    assert again == paris  # text parts join like the template sees them; the developer prompt is shared


@pytest.mark.model
async def test_anthropic_messages_send_the_key(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    url = "/v1/messages"
    system = SYSTEM["content"]
    key, _ = await post_key(client, fake, url, chat(PARIS, metadata={"user_id": "user-42"}))
    assert key == routed(opaque_key(SessionSource.ANTHROPIC_USER_ID, "user-42"))
    body = chat(PARIS, metadata={"user_id": "user-42"})
    key, _ = await post_key(client, fake, url, body, **{SESSION_HEADER: "sess-1"})
    assert key == routed(opaque_key(SessionSource.HEADER, "sess-1"))
    paris, _ = await post_key(client, fake, url, chat(PARIS, system=system))
    rome, _ = await post_key(client, fake, url, chat(ROME, system=system))
    assert (
        paris == routed(turn_key(PARIS["content"]))
        and rome == routed(turn_key(ROME["content"]))
        and paris != rome
    )


@pytest.mark.model
async def test_completions_send_only_the_header(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    body = {"model": MODEL_NAME, "prompt": "What is the capital of France?", "max_tokens": 4}
    key, _ = await post_key(client, fake, "/v1/completions", body)
    assert key == ""
    key, _ = await post_key(client, fake, "/v1/completions", body, **{SESSION_HEADER: "sess-1"})
    assert key == routed(opaque_key(SessionSource.HEADER, "sess-1"))


@pytest.mark.model
async def test_responses_key_a_conversation_across_turns(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    url = "/v1/responses"
    base = {"model": MODEL_NAME, "max_output_tokens": 4}
    first_key, first = await post_key(
        client, fake, url, {**base, "input": PARIS["content"], "instructions": "Be brief."}
    )
    assert first_key == routed(turn_key(PARIS["content"]))
    # A continuation (with other instructions) starts from the stored first turn: same session.
    follow_up = {**base, "input": "And of Italy?", "previous_response_id": first["id"], "instructions": "Hi"}
    key, _ = await post_key(client, fake, url, follow_up)
    assert key == first_key
    items = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": ROME["content"]}]
    key, _ = await post_key(client, fake, url, {**base, "input": items})
    assert key == routed(turn_key(ROME["content"]))
    key, _ = await post_key(client, fake, url, {**base, "input": "x", "prompt_cache_key": "conv-9"})
    assert key == routed(opaque_key(SessionSource.PROMPT_CACHE_KEY, "conv-9"))


@pytest.mark.model
async def test_public_grpc_sends_the_key(model_dir: Path, tokenizer: Tokenizer) -> None:
    fake = FakeBackend(identity_for(model_dir).tokenizer_fingerprint, script=scripted([[28]]))
    state = CodecState.build(fake, tokenizer, make_config(), identity_for(model_dir))
    server = PublicGrpcServer("127.0.0.1", 0, grace_s=5.0)
    system = pb.ChatMessage(role="system", content=SYSTEM["content"])
    async with server.serving(state), grpc.aio.insecure_channel(server.address) as channel:
        stub = public_pb2_grpc.InferenceStub(channel)
        for message in (PARIS, ROME):
            user = pb.ChatMessage(role="user", content=message["content"])
            [_ async for _ in stub.Chat(pb.ChatRequest(messages=[system, user]))]
        [
            _
            async for _ in stub.Chat(
                pb.ChatRequest(messages=[system]), metadata=((SESSION_HEADER, "sess-1"),)
            )
        ]
        [_ async for _ in stub.Generate(pb.TextGenerateRequest(prompt="Hello"))]
        metadata = ((SESSION_HEADER, "sess-1"),)
        [_ async for _ in stub.Generate(pb.TextGenerateRequest(prompt="Hello"), metadata=metadata)]
    assert [seen.session_key for seen in fake.seen] == [
        routed(turn_key(PARIS["content"])),
        routed(turn_key(ROME["content"])),
        routed(opaque_key(SessionSource.HEADER, "sess-1")),  # the same key as the HTTP header's
        "",
        routed(opaque_key(SessionSource.HEADER, "sess-1")),
    ]


def test_a_key_is_scoped_to_its_tenant_so_no_client_lands_in_another_tenants_session() -> None:
    def key(tenant: str) -> str:
        return session_key(client_key=(SessionSource.PROMPT_CACHE_KEY, "shared-name"), tenant=tenant)

    assert key("alpha") != key("bravo")
    assert key("alpha") == key("alpha")
    assert session_key(tenant="alpha") == ""  # no key stays no key
