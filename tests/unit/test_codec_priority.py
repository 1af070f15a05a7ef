"""Priority classes at the codec (protocols/service_tier.py): OpenAI's `service_tier` and the
x-kvrelay-priority header pick the class the backend gets, the response says the tier (and the header the
class) that served it, and the high class is a permission of the key, refused in each protocol's shape.
The official SDKs (strict, no retries) and the public gRPC API, over a fake backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import grpc
import openai
import pytest

from services.codec.admission.auth import KeyRecord, key_digest, new_key, read_keys_file, write_keys_file
from services.codec.grpc_public.server import PublicGrpcServer
from services.codec.state import CodecState
from services.codec.text.tokenizer import Tokenizer
from services.common import priority
from services.common.config import AuthConfig, KvrelayConfig
from services.proto_gen.kvrelay.v1 import public_pb2 as pb
from services.proto_gen.kvrelay.v1 import public_pb2_grpc
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted, serve_in_thread

pytestmark = pytest.mark.model

HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def fake(model_dir: Path, tokenizer: Tokenizer) -> FakeBackend:
    backend = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    backend.script = scripted([tokenizer.encode("Hello world")])
    return backend


@pytest.fixture(autouse=True)
def fresh(fake: FakeBackend) -> None:
    fake.seen.clear()


@pytest.fixture(scope="module")
def keys_and_config(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], KvrelayConfig]:
    """`plain` may not ask for the high class, `vip` may (a key made with --priority-tier)."""
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    keys, records = {}, []
    for name, allowed in (("plain", False), ("vip", True)):
        key_id, key = new_key()
        records.append(KeyRecord(key_id=key_id, tenant=name, sha256=key_digest(key), priority_tier=allowed))
        keys[name] = key
    write_keys_file(path, records)
    assert [r.priority_tier for r in read_keys_file(path)] == [False, True]
    return keys, KvrelayConfig(auth=AuthConfig(keys_file=str(path)))


@pytest.fixture(scope="module")
def base_url(
    model_dir: Path,
    tokenizer: Tokenizer,
    fake: FakeBackend,
    keys_and_config: tuple[dict[str, str], KvrelayConfig],
) -> Iterator[str]:
    with serve_in_thread(make_app(tokenizer, fake, identity_for(model_dir), keys_and_config[1])) as url:
        yield url


def openai_client(
    base_url: str, keys_and_config: tuple[dict[str, str], KvrelayConfig], who: str
) -> openai.OpenAI:
    key = keys_and_config[0][who]
    return openai.OpenAI(
        base_url=f"{base_url}/v1", api_key=key, max_retries=0, _strict_response_validation=True
    )


@pytest.mark.parametrize(
    ("tier", "served", "klass"),
    [
        (None, "default", "normal"),
        ("auto", "default", "normal"),
        ("flex", "flex", "low"),
        ("priority", "priority", "high"),
    ],
)
def test_chat_service_tier_picks_the_class_and_is_echoed(
    base_url: str, keys_and_config: tuple[dict[str, str], KvrelayConfig], fake: FakeBackend,
    tier: str | None, served: str, klass: str,
) -> None:  # fmt: skip
    client = openai_client(base_url, keys_and_config, "vip")
    extra = {} if tier is None else {"service_tier": tier}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_NAME, messages=HI, max_tokens=4, **extra
    )
    reply = raw.parse()
    assert reply.service_tier == served and raw.headers["x-kvrelay-priority"] == klass
    assert [r.priority for r in fake.seen] == [priority.BY_NAME[klass]]
    stream = client.chat.completions.create(model=MODEL_NAME, messages=HI, max_tokens=4, stream=True, **extra)
    assert {chunk.service_tier for chunk in stream} == {served}


def test_responses_service_tier_is_echoed(
    base_url: str, keys_and_config: tuple[dict[str, str], KvrelayConfig], fake: FakeBackend
) -> None:
    client = openai_client(base_url, keys_and_config, "plain")
    reply = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, service_tier="flex")
    assert reply.service_tier == "flex" and [r.priority for r in fake.seen] == [priority.LOW]


def test_the_header_sets_the_class_on_completions_and_messages(
    base_url: str, keys_and_config: tuple[dict[str, str], KvrelayConfig], fake: FakeBackend
) -> None:
    low = {"x-kvrelay-priority": "low"}
    client = openai_client(base_url, keys_and_config, "plain")
    raw = client.completions.with_raw_response.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=4, extra_headers=low
    )
    assert raw.headers["x-kvrelay-priority"] == "low"
    messages = anthropic.Anthropic(
        base_url=base_url, api_key=keys_and_config[0]["vip"], max_retries=0, _strict_response_validation=True
    )
    raw_message = messages.messages.with_raw_response.create(
        model=MODEL_NAME,
        max_tokens=4,
        messages=HI,
        extra_headers={"x-kvrelay-priority": "High"},  # type: ignore[arg-type]
    )
    assert raw_message.parse().content and raw_message.headers["x-kvrelay-priority"] == "high"
    assert [r.priority for r in fake.seen] == [priority.LOW, priority.HIGH]


def test_the_high_class_without_the_permission_is_a_400_in_each_shape(
    base_url: str, keys_and_config: tuple[dict[str, str], KvrelayConfig], fake: FakeBackend
) -> None:
    client = openai_client(base_url, keys_and_config, "plain")
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=MODEL_NAME, messages=HI, max_tokens=4, service_tier="priority")
    assert chat.value.body["param"] == "service_tier" and "--priority-tier" in chat.value.message  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as header:
        client.completions.create(
            model=MODEL_NAME, prompt="Hi", max_tokens=4, extra_headers={"x-kvrelay-priority": "high"}
        )
    assert header.value.body["param"] == "x-kvrelay-priority"  # type: ignore[index]
    messages = anthropic.Anthropic(
        base_url=base_url,
        api_key=keys_and_config[0]["plain"],
        max_retries=0,
        _strict_response_validation=True,
    )
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages.messages.create(
            model=MODEL_NAME,
            max_tokens=4,
            messages=HI,
            extra_headers={"x-kvrelay-priority": "high"},  # type: ignore[arg-type]
        )
    assert refused.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert fake.seen == []  # refused before the backend


@pytest.mark.parametrize(
    ("tier", "header", "param"),
    [
        ("flex", "high", "service_tier"),
        (None, "urgent", "x-kvrelay-priority"),
        ("default", "low", "service_tier"),
    ],
)
def test_a_bad_or_contradicting_header_is_a_400(
    base_url: str, keys_and_config: tuple[dict[str, str], KvrelayConfig], fake: FakeBackend,
    tier: str | None, header: str, param: str,
) -> None:  # fmt: skip
    client = openai_client(base_url, keys_and_config, "vip")
    extra = {} if tier is None else {"service_tier": tier}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL_NAME, messages=HI, max_tokens=4, extra_headers={"x-kvrelay-priority": header}, **extra
        )
    assert caught.value.body["param"] == param and fake.seen == []  # type: ignore[index]


@pytest.fixture
async def grpc_address(
    tokenizer: Tokenizer,
    model_dir: Path,
    fake: FakeBackend,
    keys_and_config: tuple[dict[str, str], KvrelayConfig],
) -> AsyncIterator[str]:
    state = CodecState.build(fake, tokenizer, keys_and_config[1], identity_for(model_dir))
    async with PublicGrpcServer("127.0.0.1", 0, grace_s=5.0).serving(state) as running:
        yield running.address


async def test_grpc_metadata_sets_the_class_and_the_trailer_says_it(
    grpc_address: str, keys_and_config: tuple[dict[str, str], KvrelayConfig], fake: FakeBackend
) -> None:
    chat = pb.ChatRequest(messages=[pb.ChatMessage(role="user", content="Say hello.")])
    keys = keys_and_config[0]
    async with grpc.aio.insecure_channel(grpc_address) as channel:
        stub = public_pb2_grpc.InferenceStub(channel)
        call = stub.Chat(
            chat, metadata=(("authorization", f"Bearer {keys['plain']}"), ("x-kvrelay-priority", "low"))
        )
        assert "".join([r.text async for r in call]) == "Hello world"
        assert dict(await call.trailing_metadata())["x-kvrelay-priority"] == "low"
        refused = stub.Chat(
            chat, metadata=(("authorization", f"Bearer {keys['plain']}"), ("x-kvrelay-priority", "high"))
        )
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [_ async for _ in refused]
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--priority-tier" in str(
            caught.value.details()
        )
    assert [r.priority for r in fake.seen] == [priority.LOW]
