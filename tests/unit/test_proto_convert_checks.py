"""Values from a peer are range-checked as they are converted (services/common/proto_convert.py): each one
out of range is an InvalidRequestError naming its field, which the worker, the prefill replica and the
router answer with INVALID_ARGUMENT before the engine or a replica sees the request."""

from __future__ import annotations

import math
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from services.common.engine_input import MAX_REQUEST_ID_LEN
from services.common.errors import InvalidRequestError
from services.common.grpc_auth import TokenSource
from services.common.proto_convert import engine_input_from_proto, sampling_to_proto
from services.common.sampling import SamplingParams
from services.engine.async_engine import AsyncEngine
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from services.router.replicas import ReplicaSet
from services.router.router_service import RouterService
from services.worker.worker_service import WorkerService
from tests.engine_fakes import make_fake_engine
from tests.router_fakes import FakeReplica, serve_router, start_fake

VOCAB = 128
PARAMS = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3, max_tokens=8, stop_token_ids=(9,))


def request(**fields: Any) -> pb.GenerateRequest:
    sound: dict[str, Any] = {
        "request_id": "r1",
        "prompt_token_ids": [3, 4, 5],
        "sampling": sampling_to_proto(PARAMS),
    }
    return pb.GenerateRequest(**(sound | fields))


def sampling(**fields: object) -> pb.GenerateRequest:
    msg = request()
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(msg.sampling, name)[:] = value
        else:
            setattr(msg.sampling, name, value)
    return msg


def test_sound_values_come_through_unchanged() -> None:
    got = engine_input_from_proto(request(cache_salt=b"s" * 16, priority=-3), VOCAB)
    assert (got.request_id, got.prompt_token_ids, got.params) == ("r1", [3, 4, 5], PARAMS)
    assert (got.priority, got.cache_salt) == (-3, b"s" * 16)


def test_a_prefill_request_is_checked_the_same_way() -> None:
    msg = kvpb.PrefillRequest(request_id="p", prompt_token_ids=[3, VOCAB], sampling=sampling_to_proto(PARAMS))
    with pytest.raises(InvalidRequestError, match=r"token ID 128 is outside the vocabulary \[0, 128\)"):
        engine_input_from_proto(msg, VOCAB)


def test_the_metadata_id_stands_in_for_an_empty_request_id() -> None:
    assert (
        engine_input_from_proto(request(request_id=""), VOCAB, "from-metadata").request_id == "from-metadata"
    )


HOSTILE: dict[str, tuple[Callable[[], pb.GenerateRequest], str, str]] = {
    # case: (the request, the field named, the message)
    "temperature_nan": (lambda: sampling(temperature=math.nan), "temperature", "finite number"),
    "temperature_inf": (lambda: sampling(temperature=math.inf), "temperature", "finite number"),
    "temperature_negative": (lambda: sampling(temperature=-1.0), "temperature", r"in \[0, 100\]"),
    "top_p_zero": (lambda: sampling(top_p=0.0), "top_p", r"in \(0, 1\]"),
    "top_p_over_one": (lambda: sampling(top_p=1.5), "top_p", r"in \(0, 1\]"),
    "top_k_negative": (lambda: sampling(top_k=-1), "top_k", r"in \[0, ∞\)"),
    "min_p_nan": (lambda: sampling(min_p=math.nan), "min_p", "finite number"),
    "max_tokens_zero": (lambda: sampling(max_tokens=0), "max_tokens", r"in \[1, ∞\)"),
    "min_tokens_over_max": (lambda: sampling(min_tokens=9), "min_tokens", "must not exceed"),
    "n_huge": (lambda: sampling(n=2**32 - 1), "n", r"in \[1, 16\]"),
    "seed_over_int64": (lambda: sampling(seed=2**64 - 1), "seed", r"in \[0, 9223372036854775807\]"),
    "logprobs_huge": (lambda: sampling(logprobs=1000), "logprobs", r"in \[0, 20\]"),
    "repetition_penalty_unset": (
        lambda: sampling(repetition_penalty=0.0),
        "repetition_penalty",
        "positive",
    ),
    "penalty_inf": (lambda: sampling(frequency_penalty=math.inf), "frequency_penalty", "finite"),
    "stop_token_outside_vocab": (
        lambda: sampling(stop_token_ids=[VOCAB]),
        "stop_token_ids",
        r"\[0, 127\]",
    ),
    "too_many_stop_tokens": (
        lambda: sampling(stop_token_ids=list(range(129))),
        "stop_token_ids",
        "limit",
    ),
    "empty_prompt": (lambda: request(prompt_token_ids=[]), "prompt_token_ids", "no tokens"),
    "prompt_token_outside_vocab": (
        lambda: request(prompt_token_ids=[3, 2**32 - 1]),
        "prompt_token_ids",
        r"token ID 4294967295 is outside the vocabulary \[0, 128\)",
    ),
    "empty_request_id": (lambda: request(request_id=""), "request_id", "must not be empty"),
    "long_request_id": (lambda: request(request_id="x" * 129), "request_id", "at most 128 printable ASCII"),
    "request_id_with_newline": (lambda: request(request_id="a\nb"), "request_id", "printable ASCII"),
    "request_id_not_ascii": (lambda: request(request_id="é"), "request_id", "printable ASCII"),
    "cache_salt_too_long": (lambda: request(cache_salt=b"s" * 65), "cache_salt", "65 bytes; the limit is 64"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_value_out_of_range_is_refused_naming_its_field(case: str) -> None:
    make, param, message = HOSTILE[case]
    with pytest.raises(InvalidRequestError, match=message) as refused:
        engine_input_from_proto(make(), VOCAB)
    assert refused.value.param == param


def test_the_longest_request_id_is_accepted() -> None:
    assert engine_input_from_proto(request(request_id="r" * MAX_REQUEST_ID_LEN), VOCAB).request_id


# ---- over gRPC: INVALID_ARGUMENT before the engine or a replica sees the request ------------------------


@pytest.fixture
async def worker() -> AsyncIterator[worker_pb2_grpc.WorkerStub]:
    engine = AsyncEngine(make_fake_engine(kv_cache_memory_mb=4, block_size=8))
    engine.start()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(WorkerService(engine, pb.InfoResponse()), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield worker_pb2_grpc.WorkerStub(channel)
    await server.stop(0)
    engine.shutdown()


@pytest.mark.parametrize(
    "case", ["temperature_nan", "prompt_token_outside_vocab", "long_request_id", "cache_salt_too_long"]
)
async def test_the_worker_answers_invalid_argument_with_the_message(
    worker: worker_pb2_grpc.WorkerStub, case: str
) -> None:
    make, _, message = HOSTILE[case]
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        [_ async for _ in worker.Generate(make(), timeout=5)]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, refused.value.details() or "")


async def test_the_router_refuses_a_bad_id_or_session_key_before_any_replica() -> None:
    fake = start_fake(FakeReplica("fp-checks"))
    replicas = ReplicaSet([fake.address], TokenSource("t"), watch_kv_events=False)
    await replicas.refresh()
    router = await serve_router(RouterService(replicas))
    try:
        for bad, message in [
            (request(request_id="x" * 129), "request_id must be at most 128"),
            (request(session_key="k" * 129), "session_key holds 129 characters; the limit is 128"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await router.generate(bad)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert message in (refused.value.details() or "")
        assert fake.replica.generate_calls == []
        assert await router.generate(request(session_key="k" * 32)) == [5, 6, 7]
    finally:
        await router.close()
        await replicas.close()
        fake.stop()
