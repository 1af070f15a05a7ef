"""`Worker.Abort` on a real worker process (tiny random-weight model): a running request aborted by its ID
stops where it is, its stream ends with `FINISH_REASON_ABORT`, and every block it held returns to the
pool. An ID the worker does not know is answered with an empty AbortResponse (the router broadcasts
every abort to every replica, so that case is the common one)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.stack_helpers import Proc, assert_cut_short, free_port, stack_env, wait_idle, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "abort-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)
MAX_TOKENS = 4000  # minutes of decode on one thread would be needed; the abort comes after the first token
PROMPT = [(i * 7) % 120 + 2 for i in range(40)]


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[worker_pb2_grpc.WorkerStub]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"), max_position_embeddings=4096)
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8")
    address = f"127.0.0.1:{free_port()}"
    proc = Proc(
        ["worker", "--model", str(model), "--port", address.split(":")[1], "--threads", "1"],
        env,
        tmp_path_factory.mktemp("abort-logs") / "worker.log",
    )
    try:
        wait_serving(address, proc)
        with grpc.insecure_channel(address) as channel:
            yield worker_pb2_grpc.WorkerStub(channel)
    finally:
        proc.stop()


def start(stub: worker_pb2_grpc.WorkerStub, request_id: str) -> grpc.Future:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=PROMPT, sampling=sampling_to_proto(params)
    )
    return stub.Generate(request, metadata=MD, timeout=30)


def test_abort_by_id_ends_the_stream_with_abort_and_frees_its_blocks(
    worker: worker_pb2_grpc.WorkerStub,
) -> None:
    before = wait_idle(worker, MD)
    call = start(worker, "to-abort")
    responses = iter(call)
    first = next(responses)
    assert first.token_ids and first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    load = worker.Load(pb.LoadRequest(), metadata=MD)
    assert load.running == 1 and load.kv_blocks.active >= 3, f"the request is not running: {load}"

    assert worker.Abort(pb.AbortRequest(request_id="to-abort"), metadata=MD) == pb.AbortResponse()

    rest: list[pb.GenerateResponse] = []
    try:
        rest.extend(responses)
    except grpc.RpcError as exc:
        pytest.fail(f"the aborted stream did not end cleanly: {exc.code()} {exc.details()}")
    assert call.code() == grpc.StatusCode.OK
    assert rest, "the stream ended without a final message"
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert all(r.finish_reason == pb.FINISH_REASON_UNSPECIFIED for r in rest[:-1])
    num_tokens = len(first.token_ids) + sum(len(r.token_ids) for r in rest)
    assert num_tokens < MAX_TOKENS // 4, f"{num_tokens} tokens: the abort did not stop the decode"
    after = wait_idle(worker, MD)
    assert after.kv_blocks.free + after.kv_blocks.cached == after.kv_blocks.total
    assert num_tokens <= assert_cut_short(before, after, MAX_TOKENS)


def test_abort_of_an_unknown_id_is_harmless(worker: worker_pb2_grpc.WorkerStub) -> None:
    wait_idle(worker, MD)
    call = start(worker, "keeps-running")
    responses = iter(call)
    next(responses)
    assert worker.Abort(pb.AbortRequest(request_id="no-such-request"), metadata=MD) == pb.AbortResponse()
    assert worker.Abort(pb.AbortRequest(request_id="keeps-running#0"), metadata=MD) == pb.AbortResponse()
    for _ in range(5):  # the running request goes on decoding
        response = next(responses)
        assert response.token_ids and response.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert worker.Load(pb.LoadRequest(), metadata=MD).running == 1
    call.cancel()
    wait_idle(worker, MD)
