"""The public gRPC API (kvrelay.v1.Inference) over a fake backend: streams, sampling, errors, aborts."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from services.codec.grpc_public.server import PublicGrpcServer
from services.codec.state import CodecIdentity, CodecState
from services.codec.text.prompts import encode_chat
from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig
from services.common.grammar import GrammarKind, GrammarSpec
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import public_pb2 as pb
from services.proto_gen.kvrelay.v1 import public_pb2_grpc
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_config, scripted

pytestmark = pytest.mark.model

FRANCE = [pb.ChatMessage(role="user", content="What is the capital of France?")]
Response = pb.ChatResponse | pb.TextGenerateResponse


@dataclass
class Api:
    stub: public_pb2_grpc.InferenceStub
    fake: FakeBackend
    state: CodecState
    server: PublicGrpcServer


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def identity(model_dir: Path) -> CodecIdentity:
    return identity_for(model_dir)


async def serve_api(
    tokenizer: Tokenizer, identity: CodecIdentity, config: KvrelayConfig | None = None
) -> AsyncIterator[Api]:
    fake = FakeBackend(identity.tokenizer_fingerprint)
    state = CodecState.build(fake, tokenizer, config or make_config(), identity)
    server = PublicGrpcServer("127.0.0.1", 0, grace_s=5.0)
    async with server.serving(state), grpc.aio.insecure_channel(server.address) as channel:
        yield Api(public_pb2_grpc.InferenceStub(channel), fake, state, server)


@pytest.fixture
async def api(tokenizer: Tokenizer, identity: CodecIdentity) -> AsyncIterator[Api]:
    async for running in serve_api(tokenizer, identity):
        yield running


def chat(**sampling: object) -> pb.ChatRequest:
    return pb.ChatRequest(messages=FRANCE, sampling=pb.SamplingOptions(**sampling))  # type: ignore[arg-type]


def texts(messages: list[Response]) -> dict[int, str]:
    joined: dict[int, str] = {}
    for message in messages:
        joined[message.index] = joined.get(message.index, "") + message.text
    return joined


async def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


async def test_chat_streams_text_then_finish_and_usage_on_the_last_message(
    api: Api, tokenizer: Tokenizer
) -> None:
    ids = tokenizer.encode(" Paris is the capital.", add_special_tokens=False)
    api.fake.script = scripted([ids], num_cached_tokens=3)
    messages = [message async for message in api.stub.Chat(chat(temperature=0.0))]
    assert texts(messages) == {0: tokenizer.decode(ids)}
    assert all(not m.HasField("finish") for m in messages[:-1])
    last = messages[-1]
    assert last.finish.reason == pb.SampleFinish.STOP and last.finish.matched_stop == ""
    assert last.finish.num_tokens == len(ids) + 1  # EOS counts, and is not text
    prompt = api.fake.seen[0].prompt_token_ids
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), len(ids) + 1)
    assert last.usage.cached_tokens == 3


async def test_chat_prompt_is_the_http_rendering(api: Api, tokenizer: Tokenizer) -> None:
    api.fake.script = scripted([[28]])
    [_ async for _ in api.stub.Chat(chat())]
    template = api.state.require_chat_template()
    messages = [{"role": "user", "content": FRANCE[0].content}]
    assert api.fake.seen[0].prompt_token_ids == encode_chat(template, tokenizer, messages, api.state.metrics)


async def test_unset_options_take_the_http_defaults(api: Api) -> None:
    api.fake.script = scripted([[28]])
    [_ async for _ in api.stub.Chat(chat())]
    sampling = api.fake.seen[0].sampling
    assert sampling == SamplingParams(max_tokens=sampling.max_tokens)
    assert api.fake.seen[0].timeout_s == api.state.request_timeout_s


async def test_sampling_options_reach_the_backend(api: Api) -> None:
    api.fake.script = scripted([[28], [29]], finish_reason="length", logprobs=True)
    request = chat(
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        n=2,
        logprobs=True,
        top_logprobs=2,
        ignore_eos=True,
        min_tokens=1,
        stop_token_ids=[5],
    )
    messages = [message async for message in api.stub.Chat(request)]
    expected = SamplingParams(2, 0.5, 0.9, 40, 0.05, 1.1, -0.5, 0.5, 11, 7, 1, (5,), True, 2)
    assert api.fake.seen[0].sampling == expected
    finishes = {m.index: m.finish for m in messages if m.HasField("finish")}
    assert [finishes[i].reason for i in (0, 1)] == [pb.SampleFinish.LENGTH] * 2
    logprobs = [m.logprobs[0] for m in messages if m.logprobs]
    assert [item.token_id for item in logprobs] == [28, 29]
    assert logprobs[0].logprob == pytest.approx(-0.1)
    assert [alt.token_id for alt in logprobs[0].top_logprobs] == [28, 0]


async def test_stop_string_ends_the_sample_and_aborts_the_rest(api: Api, tokenizer: Tokenizer) -> None:
    api.fake.script = scripted([tokenizer.encode(" one two three four", add_special_tokens=False)])
    messages = [message async for message in api.stub.Chat(chat(stop=["three"]))]
    assert texts(messages) == {0: " one two "}
    assert messages[-1].finish.matched_stop == "three"
    assert messages[-1].finish.reason == pb.SampleFinish.STOP
    await wait_for(lambda: len(api.fake.closed_early) == 1)


async def test_generate_takes_text_or_token_ids(api: Api, tokenizer: Tokenizer) -> None:
    api.fake.script = scripted([tokenizer.encode(" Paris", add_special_tokens=False)])
    request = pb.TextGenerateRequest(prompt="The capital of France is")
    messages = [message async for message in api.stub.Generate(request)]
    assert texts(messages) == {0: " Paris"} and messages[-1].usage.completion_tokens == 2
    assert api.fake.seen[0].prompt_token_ids == tokenizer.encode("The capital of France is")
    by_ids = pb.TextGenerateRequest(prompt_token_ids=[1, 2, 3], model=MODEL_NAME)
    [_ async for _ in api.stub.Generate(by_ids)]
    assert api.fake.seen[1].prompt_token_ids == [1, 2, 3]


BAD_CHATS = {
    "no messages": pb.ChatRequest(),
    "unknown role": pb.ChatRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]),
    "temperature": chat(temperature=2.5),
    "top_p": chat(top_p=0.0),
    "n": chat(n=17),
    "top_logprobs": chat(logprobs=True, top_logprobs=21),
    "top_logprobs without logprobs": chat(top_logprobs=2),
    "too many stop strings": chat(stop=["a", "b", "c", "d", "e"]),
    "empty stop string": chat(stop=[""]),
    "seed": chat(seed=2**63),
    "max_tokens": chat(max_tokens=0),
    "max_tokens over the server's limit": chat(max_tokens=5000),
    "penalty": chat(presence_penalty=3.0),
}


@pytest.mark.parametrize("name", list(BAD_CHATS))
async def test_bad_chat_is_invalid_argument_before_the_backend(api: Api, name: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in api.stub.Chat(BAD_CHATS[name])]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert caught.value.details()
    assert api.fake.seen == []


BAD_GENERATES = {
    "no prompt": pb.TextGenerateRequest(),
    "both prompts": pb.TextGenerateRequest(prompt="hi", prompt_token_ids=[1]),
    "token outside the vocabulary": pb.TextGenerateRequest(prompt_token_ids=[1, 10**6]),
    "prompt over the context": pb.TextGenerateRequest(prompt_token_ids=[1] * 3000),
    "prompt + max_tokens over the context": pb.TextGenerateRequest(
        prompt_token_ids=[1] * 1500, sampling=pb.SamplingOptions(max_tokens=1000)
    ),
    "top_logprobs": pb.TextGenerateRequest(
        prompt="hi", sampling=pb.SamplingOptions(logprobs=True, top_logprobs=21)
    ),
}


@pytest.mark.parametrize("name", list(BAD_GENERATES))
async def test_bad_generate_is_invalid_argument_before_the_backend(api: Api, name: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in api.stub.Generate(BAD_GENERATES[name])]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert api.fake.seen == []


async def test_error_messages_name_the_field(api: Api) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in api.stub.Chat(BAD_CHATS["unknown role"])]
    assert "messages[0].role" in (caught.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in api.stub.Generate(BAD_GENERATES["prompt over the context"])]
    assert "the prompt has 3000 tokens" in (caught.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in api.stub.Generate(BAD_GENERATES["top_logprobs"])]
    assert "top_logprobs" in (caught.value.details() or "")


async def test_unknown_model_is_not_found(api: Api) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in api.stub.Chat(pb.ChatRequest(model="gpt-9", messages=FRANCE))]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert api.fake.seen == []


async def test_backend_down_is_unavailable(api: Api) -> None:
    api.fake.is_unavailable = True
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in api.stub.Chat(chat())]
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_failure_mid_stream_is_internal(api: Api) -> None:
    api.fake.script = scripted([[28, 29, 30, 31]])
    api.fake.fail_after = 2
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in api.stub.Chat(chat())]
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "request req_" in (caught.value.details() or "")


async def test_client_cancel_aborts_the_generation(api: Api, tokenizer: Tokenizer) -> None:
    api.fake.script = scripted([tokenizer.encode(" one" * 400, add_special_tokens=False)])
    api.fake.delay_s = 0.02  # about 8 s unless aborted
    call = api.stub.Chat(chat())
    assert (await call.read()).text
    call.cancel()
    await wait_for(lambda: len(api.fake.closed_early) == 1)
    assert api.fake.completed == []
    await wait_for(lambda: api.state.generator.num_running == 0)


async def test_request_id_and_deadline(api: Api) -> None:
    api.fake.script = scripted([[28]])
    call = api.stub.Chat(chat(), metadata=(("x-request-id", "client-7"),), timeout=3.0)
    [_ async for _ in call]
    metadata = list(await call.initial_metadata())
    assert ("x-request-id", "client-7") in metadata
    fingerprint = api.state.identity.model_fingerprint[:16]
    assert ("x-kvrelay-model-fingerprint", fingerprint) in metadata, "which release answered"
    seen = api.fake.seen[0]
    assert re.fullmatch(r"req_[0-9a-f]{24}", seen.request_id), "the inward ID is the server's own"
    assert seen.timeout_s is not None and seen.timeout_s <= 3.1  # grpc-timeout rounds the deadline up


async def test_structured_output_reaches_the_backend_and_a_bad_one_is_invalid_argument(api: Api) -> None:
    api.fake.script = scripted([[28]])
    schema = '{"type":"object","properties":{"a":{"type":"integer"}}}'
    [_ async for _ in api.stub.Chat(chat(structured_output=pb.StructuredOutput(json_schema=schema)))]
    assert api.fake.seen[-1].sampling.grammar == GrammarSpec(GrammarKind.JSON_SCHEMA, schema)
    choices = pb.StructuredOutput(choice=pb.StructuredOutput.Choices(values=["yes", "no"]))
    [_ async for _ in api.stub.Chat(chat(structured_output=choices))]
    assert api.fake.seen[-1].sampling.grammar == GrammarSpec.choice(["yes", "no"])
    seen = len(api.fake.seen)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in api.stub.Chat(chat(structured_output=pb.StructuredOutput(regex="a(b")))]
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
    assert "regex" in (caught.value.details() or "") and len(api.fake.seen) == seen
