"""`POST /v1/responses/compact` against the real codec app in process, with the fake backend at the seam
playing scripted SmolLM2 tokens: a 10-turn conversation folds into one sealed `compaction` item (the
vendored Open Responses `CompactResource`, also through the strict openai SDK); sent back with the next
user message it opens into its summary and the prompt shrinks; a tampered item, or one from another
tenant or model, is a 400 no worker sees; a key ring opens what its older key sealed; the request's own
refusals (nothing to compact, unknown previous response, unknown field) and the compaction counter; and
an image on this text-only model is a 400 naming vision."""

from __future__ import annotations

import base64
import os
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import httpx2
import openai
import pytest
from fastapi import FastAPI

from services.codec.admission.auth import KeyRecord, key_digest, new_key, read_keys_file, write_keys_file
from services.codec.protocols.openai_responses_compact import SUMMARY_INSTRUCTIONS
from services.codec.state import CodecIdentity
from services.codec.text.tokenizer import Tokenizer
from services.common.config import AuthConfig, KvrelayConfig, LimitsConfig, ResponsesConfig
from tests import openresponses_schemas as spec
from tests.codec_fakes import MODEL_NAME, FakeBackend, make_app, scripted, serve_in_thread

pytestmark = pytest.mark.model

SUMMARY = "SUMMARY-MARKER the user asked about ten topics, one per turn, and each got a short answer."
NEXT = "next question"
SUMMARY_HEADING = "Summary of the conversation so far:"
OTHER_MODEL = "other-model"


def user_turn(number: int) -> str:
    return f"Turn {number}: please tell me about topic number {number} and why it matters so much."


def assistant_turn(number: int) -> str:
    return f"Topic {number} matters because reply {number} explains it in a few careful sentences."


TEN_TURNS: list[dict[str, Any]] = [
    message
    for number in range(1, 11)
    for message in (
        {"role": "user", "content": user_turn(number)},
        {"role": "assistant", "content": assistant_turn(number)},
    )
]


def write_compaction_keys(path: Path, *key_ids: str, keys: dict[str, str] | None = None) -> Path:
    """A compaction keys file of `key_ids` in order; `keys` (id -> base64) remembers each key across files."""
    known = keys if keys is not None else {}
    for key_id in key_ids:
        known.setdefault(key_id, base64.b64encode(os.urandom(32)).decode("ascii"))
    path.write_text("".join(f"{key_id}:{known[key_id]}\n" for key_id in key_ids), encoding="utf-8")
    return path


def add_api_key(path: Path, tenant: str) -> str:
    """Appends a fresh API key for `tenant` to the auth keys file; the key."""
    records = read_keys_file(path) if path.exists() else []
    key_id, key = new_key()
    write_keys_file(path, [*records, KeyRecord(key_id=key_id, tenant=tenant, sha256=key_digest(key))])
    return key


def build_app(
    tokenizer: Tokenizer,
    fake: FakeBackend,
    identity: CodecIdentity,
    compaction_keys: Path | None,
    auth_keys: Path | None = None,
) -> FastAPI:
    config = KvrelayConfig(
        limits=LimitsConfig(),
        responses=ResponsesConfig(compaction_keys_file=str(compaction_keys) if compaction_keys else None),
        auth=AuthConfig(keys_file=str(auth_keys) if auth_keys else None),
    )
    return make_app(tokenizer, fake, identity, config)


def client_for(app: FastAPI, api_key: str | None = None) -> httpx.AsyncClient:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://codec", headers=headers, timeout=30
    )


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    return write_compaction_keys(tmp_path / "compaction-keys", "k1")


@pytest.fixture
def app(tokenizer: Tokenizer, fake: FakeBackend, identity: CodecIdentity, keys_file: Path) -> FastAPI:
    return build_app(tokenizer, fake, identity, keys_file)


@pytest.fixture
async def client(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with client_for(app) as client:
        yield client


def plays(fake: FakeBackend, tokenizer: Tokenizer, text: str) -> list[int]:
    """The fake answers every request with `text` (then EOS); the ids it plays."""
    ids = tokenizer.encode(text)
    fake.script = scripted([ids])
    return ids


def last_prompt(fake: FakeBackend, tokenizer: Tokenizer) -> str:
    return tokenizer.decode(fake.seen[-1].prompt_token_ids, skip_special_tokens=False)


async def compact(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, **fields: Any
) -> dict[str, Any]:
    plays(fake, tokenizer, SUMMARY)
    response = await client.post("/v1/responses/compact", json={"model": MODEL_NAME, **fields})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def continue_with(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer, items: list[dict[str, Any]]
) -> httpx.Response:
    plays(fake, tokenizer, "An answer to the next question.")
    return await client.post(
        "/v1/responses",
        json={"model": MODEL_NAME, "input": [*items, {"role": "user", "content": NEXT}], "store": False},
    )


def assert_refused(response: httpx.Response, status: int, param: str | None, code: str | None = None) -> str:
    """An error in OpenAI's shape with `param` (and `code` when given); its message."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error", error
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return str(error["message"])


def compactions_counted(text: str) -> float:
    match = re.search(r"^kvrelay_codec_compactions_total (\S+)$", text, re.MULTILINE)
    assert match, "kvrelay_codec_compactions_total is not exported"
    return float(match.group(1))


# ---- the compacted window ---------------------------------------------------------------------------------


async def test_ten_turns_compact_into_one_sealed_item_that_shrinks_the_next_prompt(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    summary_ids = tokenizer.encode(SUMMARY)
    body = await compact(client, fake, tokenizer, input=TEN_TURNS)

    spec.validate("CompactResource", body)
    assert body["object"] == "response.compaction" and body["id"].startswith("resp_")
    [item] = body["output"]
    assert item["type"] == "compaction" and item["id"].startswith("cmp_")
    assert "SUMMARY-MARKER" not in item["encrypted_content"] and SUMMARY not in item["encrypted_content"]

    # The summarizer read the whole conversation under its instructions, greedily.
    [summarizer] = fake.seen
    summarizer_prompt = tokenizer.decode(summarizer.prompt_token_ids, skip_special_tokens=False)
    assert SUMMARY_INSTRUCTIONS in summarizer_prompt
    for number in range(1, 11):
        assert user_turn(number) in summarizer_prompt and assistant_turn(number) in summarizer_prompt
    assert summarizer.sampling.temperature == 0.0
    usage = body["usage"]
    assert usage["input_tokens"] == len(summarizer.prompt_token_ids)
    assert usage["output_tokens"] == len(summary_ids) + 1  # the summary, then EOS, as the fake played
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]

    compacted = await continue_with(client, fake, tokenizer, body["output"])
    assert compacted.status_code == 200, compacted.text
    assert compacted.json()["status"] == "completed"
    compacted_prompt = last_prompt(fake, tokenizer)
    compacted_ids = fake.seen[-1].prompt_token_ids
    assert f"{SUMMARY_HEADING}\n{SUMMARY}\n\n{NEXT}" in compacted_prompt  # one user message, summary first
    assert user_turn(1) not in compacted_prompt and assistant_turn(10) not in compacted_prompt
    assert compacted.json()["usage"]["input_tokens"] == len(compacted_ids)

    full = await continue_with(client, fake, tokenizer, TEN_TURNS)
    assert full.status_code == 200, full.text
    full_ids = fake.seen[-1].prompt_token_ids
    assert user_turn(1) in last_prompt(fake, tokenizer)
    assert len(compacted_ids) < len(full_ids)
    assert len(fake.seen) == 3


async def test_compact_continues_a_stored_conversation_by_previous_response_id(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    previous_id = None
    for number in range(1, 4):
        plays(fake, tokenizer, assistant_turn(number))
        turn = {"model": MODEL_NAME, "input": user_turn(number), "store": True}
        if previous_id is not None:
            turn["previous_response_id"] = previous_id
        response = await client.post("/v1/responses", json=turn)
        assert response.status_code == 200, response.text
        previous_id = response.json()["id"]

    body = await compact(client, fake, tokenizer, previous_response_id=previous_id)
    spec.validate("CompactResource", body)
    summarizer_prompt = last_prompt(fake, tokenizer)
    for number in range(1, 4):
        assert user_turn(number) in summarizer_prompt and assistant_turn(number) in summarizer_prompt

    continued = await continue_with(client, fake, tokenizer, body["output"])
    assert continued.status_code == 200, continued.text
    assert f"{SUMMARY}\n\n{NEXT}" in last_prompt(fake, tokenizer)
    assert user_turn(1) not in last_prompt(fake, tokenizer)


async def test_a_window_and_later_turns_compact_again(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    window = (await compact(client, fake, tokenizer, input=TEN_TURNS))["output"]
    later = [{"role": "user", "content": user_turn(11)}, {"role": "assistant", "content": assistant_turn(11)}]
    again = await compact(client, fake, tokenizer, input=[*window, *later])
    spec.validate("CompactResource", again)
    summarizer_prompt = last_prompt(fake, tokenizer)
    assert SUMMARY in summarizer_prompt and user_turn(11) in summarizer_prompt  # the old summary is read
    assert user_turn(1) not in summarizer_prompt
    assert again["output"][0]["encrypted_content"] != window[0]["encrypted_content"]


@pytest.fixture
def base_url(app: FastAPI) -> Iterator[str]:
    with serve_in_thread(app) as url:
        yield url


def test_the_strict_openai_sdk_compacts_and_continues(
    base_url: str, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    with openai.OpenAI(
        base_url=f"{base_url}/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
        http_client=httpx2.Client(timeout=30),
    ) as sdk:
        plays(fake, tokenizer, SUMMARY)
        compacted = sdk.responses.compact(model=MODEL_NAME, input=TEN_TURNS)  # type: ignore[arg-type]
        assert compacted.object == "response.compaction"
        [item] = compacted.output
        assert item.type == "compaction" and SUMMARY not in item.encrypted_content
        assert compacted.usage.input_tokens == len(fake.seen[-1].prompt_token_ids)

        plays(fake, tokenizer, "An answer to the next question.")
        window: list[Any] = [entry.model_dump(exclude_none=True) for entry in compacted.output]
        response = sdk.responses.create(
            model=MODEL_NAME, input=[*window, {"role": "user", "content": NEXT}], store=False
        )
    assert response.status == "completed"
    assert response.output_text == "An answer to the next question."
    assert f"{SUMMARY}\n\n{NEXT}" in last_prompt(fake, tokenizer)


# ---- items that do not open --------------------------------------------------------------------------------


def tampered(blob: str) -> str:
    middle = len(blob) // 2
    flipped = "A" if blob[middle] != "A" else "B"
    return blob[:middle] + flipped + blob[middle + 1 :]


async def test_a_tampered_item_is_a_400_no_worker_sees(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    [item] = (await compact(client, fake, tokenizer, input=TEN_TURNS))["output"]
    forged = {**item, "encrypted_content": tampered(item["encrypted_content"])}
    seen = len(fake.seen)

    response = await continue_with(client, fake, tokenizer, [forged])
    message = assert_refused(response, 400, "input[0].encrypted_content")
    assert "failed authentication" in message and SUMMARY not in message
    assert len(fake.seen) == seen


async def test_another_tenants_item_is_a_400(
    tmp_path: Path,
    tokenizer: Tokenizer,
    fake: FakeBackend,
    identity: CodecIdentity,
    keys_file: Path,
) -> None:
    auth_keys = tmp_path / "api-keys.yaml"
    acme_key, beta_key = add_api_key(auth_keys, "acme"), add_api_key(auth_keys, "beta")
    app = build_app(tokenizer, fake, identity, keys_file, auth_keys)
    async with client_for(app, acme_key) as acme, client_for(app, beta_key) as beta:
        window = (await compact(acme, fake, tokenizer, input=TEN_TURNS))["output"]
        seen = len(fake.seen)
        assert_refused(await continue_with(beta, fake, tokenizer, window), 400, "input[0].encrypted_content")
        assert len(fake.seen) == seen
        opened = await continue_with(acme, fake, tokenizer, window)  # its own tenant opens it
        assert opened.status_code == 200, opened.text
        assert SUMMARY in last_prompt(fake, tokenizer)


async def test_another_models_item_is_a_400(
    tokenizer: Tokenizer,
    fake: FakeBackend,
    identity: CodecIdentity,
    keys_file: Path,
    client: httpx.AsyncClient,
) -> None:
    other_identity = CodecIdentity(OTHER_MODEL, identity.tokenizer_fingerprint, identity.model_fingerprint)
    other_app = build_app(tokenizer, fake, other_identity, keys_file)
    window = (await compact(client, fake, tokenizer, input=TEN_TURNS))["output"]
    seen = len(fake.seen)
    async with client_for(other_app) as other:
        plays(fake, tokenizer, "An answer.")
        response = await other.post(
            "/v1/responses",
            json={"model": OTHER_MODEL, "input": [*window, {"role": "user", "content": NEXT}]},
        )
    assert_refused(response, 400, "input[0].encrypted_content")
    assert len(fake.seen) == seen


async def test_a_rotated_ring_opens_what_its_old_key_sealed(
    tmp_path: Path, tokenizer: Tokenizer, fake: FakeBackend, identity: CodecIdentity
) -> None:
    keys: dict[str, str] = {}
    old_file = write_compaction_keys(tmp_path / "old", "old", keys=keys)
    ring_file = write_compaction_keys(tmp_path / "ring", "new", "old", keys=keys)
    before = build_app(tokenizer, fake, identity, old_file)
    after = build_app(tokenizer, fake, identity, ring_file)
    async with client_for(before) as old_codec, client_for(after) as new_codec:
        old_window = (await compact(old_codec, fake, tokenizer, input=TEN_TURNS))["output"]
        assert old_window[0]["encrypted_content"].startswith("kvc1.old.")
        opened = await continue_with(new_codec, fake, tokenizer, old_window)
        assert opened.status_code == 200, opened.text
        assert f"{SUMMARY}\n\n{NEXT}" in last_prompt(fake, tokenizer)

        new_window = (await compact(new_codec, fake, tokenizer, input=TEN_TURNS))["output"]
        assert new_window[0]["encrypted_content"].startswith("kvc1.new.")  # the first key seals
        seen = len(fake.seen)
        refused = await continue_with(old_codec, fake, tokenizer, new_window)  # the old codec lacks "new"
        assert "key this server does not hold" in assert_refused(refused, 400, "input[0].encrypted_content")
        assert len(fake.seen) == seen


# ---- the request's own refusals, and the counter -----------------------------------------------------------


async def test_nothing_to_compact_is_a_400_naming_input(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    response = await client.post("/v1/responses/compact", json={"model": MODEL_NAME})
    assert_refused(response, 400, "input")
    assert fake.seen == []


async def test_an_unknown_previous_response_is_a_404(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    response = await client.post(
        "/v1/responses/compact", json={"model": MODEL_NAME, "previous_response_id": "resp_nope"}
    )
    assert_refused(response, 404, "previous_response_id", "previous_response_not_found")
    assert fake.seen == []


async def test_an_unknown_field_is_a_400(client: httpx.AsyncClient, fake: FakeBackend) -> None:
    response = await client.post(
        "/v1/responses/compact", json={"model": MODEL_NAME, "input": "hi", "temperature": 0.5}
    )
    assert_refused(response, 400, "temperature", "unknown_parameter")
    assert fake.seen == []


async def test_each_compaction_counts_once(
    client: httpx.AsyncClient, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    before = compactions_counted((await client.get("/metrics")).text)
    await compact(client, fake, tokenizer, input=TEN_TURNS)
    assert compactions_counted((await client.get("/metrics")).text) == before + 1
    await compact(client, fake, tokenizer, input="just one message")
    await client.post("/v1/responses/compact", json={"model": MODEL_NAME})  # refused: not counted
    assert compactions_counted((await client.get("/metrics")).text) == before + 2


# ---- media on this text-only model -------------------------------------------------------------------------

IMAGE_MESSAGE = {
    "role": "user",
    "content": [
        {"type": "input_text", "text": "What is in this picture?"},
        {"type": "input_image", "image_url": "https://x/y.png"},
    ],
}


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/responses/compact"])
async def test_an_image_is_a_400_naming_vision(
    client: httpx.AsyncClient, fake: FakeBackend, route: str
) -> None:
    response = await client.post(route, json={"model": MODEL_NAME, "input": [IMAGE_MESSAGE]})
    message = assert_refused(response, 400, "input[0].content[1]")
    assert "image input" in message and "vision" in message, message
    assert fake.seen == []
