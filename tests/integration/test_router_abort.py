"""`Worker.Abort` sent to the router, on a real router process over a real worker (tiny random-weight
model) and a fake replica: the abort reaches every replica, the worker serving the request stops it where
it is (its stream through the router ends with FINISH_REASON_ABORT after far fewer tokens than asked),
and the worker is idle again with every block back in the pool and one more aborted request counted."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from services.common.manifest import load_verified_manifest
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.router_fakes import FakeReplica, start_fake
from tests.stack_helpers import Proc, assert_cut_short, free_port, stack_env, wait_idle, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "router-abort-token"
MD = (("authorization", f"Bearer {TOKEN}"),)
MAX_TOKENS = 4000
PROMPT = [(i * 5) % 120 + 2 for i in range(40)]


def wait_ready(channel: grpc.Channel, num_replicas: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        listed = worker_pb2_grpc.RouterStub(channel).Replicas(pb.ReplicasRequest(), metadata=MD).replicas
        if len(listed) == num_replicas and all(r.ready for r in listed):
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the router's replicas not all ready within {timeout_s} s: {listed}")
        time.sleep(0.05)


def test_abort_through_the_router_stops_the_request_on_its_worker(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny", max_position_embeddings=4096)
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8")
    worker_address, router_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    fake = start_fake(FakeReplica(load_verified_manifest(model).model_fingerprint))
    worker = Proc(
        ["worker", "--model", str(model), "--port", worker_address.split(":")[1], "--threads", "1"],
        env,
        tmp_path / "worker.log",
    )
    router = Proc(  # round-robin over [worker, fake]: the first request goes to the worker
        ["router", "--port", router_address.split(":")[1], "--workers", f"{worker_address},{fake.address}"],
        stack_env(TOKEN, KVRELAY_ROUTER__POLICY="round_robin"),
        tmp_path / "router.log",
    )
    try:
        wait_serving(worker_address, worker)
        wait_serving(router_address, router)
        with grpc.insecure_channel(worker_address) as w, grpc.insecure_channel(router_address) as r:
            run_and_abort(worker_pb2_grpc.WorkerStub(w), worker_pb2_grpc.WorkerStub(r), r)
    finally:
        router.stop()
        worker.stop()
        fake.stop()
    assert fake.replica.abort_calls == ["abort-me"]  # the router sends every abort to every replica
    assert fake.replica.generate_calls == []


def run_and_abort(
    worker: worker_pb2_grpc.WorkerStub, router: worker_pb2_grpc.WorkerStub, channel: grpc.Channel
) -> None:
    wait_ready(channel, 2)
    before = wait_idle(worker, MD)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    request = pb.GenerateRequest(
        request_id="abort-me", prompt_token_ids=PROMPT, sampling=sampling_to_proto(params)
    )
    call = router.Generate(request, metadata=MD, timeout=60)
    responses = iter(call)
    first = next(responses)
    assert first.token_ids and first.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    load = worker.Load(pb.LoadRequest(), metadata=MD)
    assert load.running == 1, f"the request is not running on the worker: {load}"

    assert router.Abort(pb.AbortRequest(request_id="abort-me"), metadata=MD) == pb.AbortResponse()

    try:
        rest = list(responses)
    except grpc.RpcError as exc:
        pytest.fail(
            f"the aborted stream did not end cleanly through the router: {exc.code()} {exc.details()}"
        )
    num_tokens = len(first.token_ids) + sum(len(r.token_ids) for r in rest)
    finish = pb.FinishReason.Name(rest[-1].finish_reason) if rest else "no final message"
    assert finish == "FINISH_REASON_ABORT", f"the stream ended with {finish} after {num_tokens} tokens"
    assert num_tokens < MAX_TOKENS // 4, f"{num_tokens} tokens: the abort did not stop the decode"
    after = wait_idle(worker, MD)
    assert after.kv_blocks.free + after.kv_blocks.cached == after.kv_blocks.total
    assert num_tokens <= assert_cut_short(before, after, MAX_TOKENS)
