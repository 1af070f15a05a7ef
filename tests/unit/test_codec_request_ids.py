"""Inward request IDs are the codec's own (`req_<24 hex digits>`), whatever the client sends: a client's
`x-request-id` names its request in the response header and the access log only, so two clients (or
one client twice) with one ID never share an ID behind the codec."""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.codec.middleware import new_request_ids
from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

INWARD = re.compile(r"req_[0-9a-f]{24}")
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}


def test_a_client_id_is_kept_for_the_client_and_the_inward_id_is_generated() -> None:
    seen, inward = new_request_ids("client-7")
    assert seen == "client-7" and INWARD.fullmatch(inward)
    assert new_request_ids("client-7")[1] != inward


@pytest.mark.parametrize("given", [None, "", "bad id with spaces", "x" * 200])
def test_without_a_sane_client_id_both_ids_are_the_generated_one(given: str | None) -> None:
    seen, inward = new_request_ids(given)
    assert seen == inward and INWARD.fullmatch(inward)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake(model_dir: Path, tokenizer: Tokenizer) -> FakeBackend:
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    backend.script = scripted([tokenizer.encode("Hello")])
    return backend


@pytest.fixture
async def client(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> AsyncIterator[httpx.AsyncClient]:
    app = make_app(tokenizer, fake, identity_for(model_dir))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client


async def test_one_client_id_twice_goes_inward_as_two_generated_ids(
    client: httpx.AsyncClient, fake: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="kvrelay.access"):
        replies = [
            await client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "client-7"})
            for _ in range(2)
        ]
    assert [r.status_code for r in replies] == [200, 200]
    assert [r.headers["x-request-id"] for r in replies] == ["client-7", "client-7"]
    inward = [seen.request_id for seen in fake.seen]
    assert all(INWARD.fullmatch(i) for i in inward) and inward[0] != inward[1], inward
    access = [r.__dict__ for r in caplog.records if r.name == "kvrelay.access"]
    assert [(a["request_id"], a["inward_request_id"]) for a in access] == [("client-7", i) for i in inward]


async def test_without_a_client_id_the_response_names_the_inward_id(
    client: httpx.AsyncClient, fake: FakeBackend
) -> None:
    reply = await client.post("/v1/chat/completions", json=CHAT)
    assert reply.status_code == 200
    assert reply.headers["x-request-id"] == fake.seen[0].request_id
    assert INWARD.fullmatch(fake.seen[0].request_id)


async def test_every_response_says_which_release_answered(
    model_dir: Path, tokenizer: Tokenizer, fake: FakeBackend
) -> None:
    identity = dataclasses.replace(identity_for(model_dir), model_version="smollm2-v2")
    app = make_app(tokenizer, fake, identity)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        replies = [await client.post("/v1/chat/completions", json=CHAT), await client.get("/v1/nope")]
    assert [r.status_code for r in replies] == [200, 404]
    for reply in replies:  # errors too: a canary's failures must name the canary
        assert reply.headers["x-kvrelay-model-version"] == "smollm2-v2"
        assert reply.headers["x-kvrelay-model-fingerprint"] == identity.model_fingerprint[:16]
