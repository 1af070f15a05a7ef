"""`Worker.KVEvents` on a real worker process (tiny random-weight model, a 16-block KV cache): the first
batch is a snapshot of the prefix cache, later batches are the blocks stored and evicted since, and every
hash is the chained block hash of docs/block-hashing.md, computed here from the prompt."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from services.common.block_hash import hash_token_blocks, root_hash
from services.common.manifest import load_verified_manifest
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "kv-events-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)
BLOCK_SIZE = 16
WARM_UP_PROMPT = list(range(1, 17))  # services/worker/server.py warm_up: one full block, cached at start


@dataclass
class Worker:
    stub: worker_pb2_grpc.WorkerStub
    root: bytes

    def hashes(self, prompt: list[int]) -> list[bytes]:
        return hash_token_blocks(self.root, prompt, BLOCK_SIZE)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    # 2 layers x (K, V) x 4 KV heads x 64 dims x 4 bytes = 4 KiB a token: a 1 MB cache is 16 blocks.
    model = make_tiny_llama(
        tmp_path_factory.mktemp("tiny"), hidden_size=256, num_attention_heads=4, num_key_value_heads=4
    )
    env = stack_env(
        TOKEN,
        KVRELAY_MODEL__DTYPE="float32",
        KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="1",
        KVRELAY_ENGINE__MAX_MODEL_LEN="128",
        KVRELAY_LIMITS__MAX_OUTPUT_TOKENS="64",
        KVRELAY_LIMITS__DEFAULT_MAX_OUTPUT_TOKENS="16",
    )
    address = f"127.0.0.1:{free_port()}"
    proc = Proc(
        ["worker", "--model", str(model), "--port", address.split(":")[1], "--threads", "1"],
        env,
        tmp_path_factory.mktemp("kv-events-logs") / "worker.log",
    )
    try:
        wait_serving(address, proc)
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            fingerprint = load_verified_manifest(model).model_fingerprint
            assert stub.Info(pb.InfoRequest(), metadata=MD).model_fingerprint == fingerprint
            assert stub.Load(pb.LoadRequest(), metadata=MD).kv_blocks.total == 16
            yield Worker(stub, root_hash(fingerprint))
    finally:
        proc.stop()


class Subscription:
    """A KVEvents stream read on a thread, so the test can wait for a batch with a bound."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub) -> None:
        self.call = stub.KVEvents(pb.KVEventsRequest(), metadata=MD, timeout=60)
        self.batches: queue.Queue[pb.KVEventBatch] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for batch in self.call:
                self.batches.put(batch)
        except grpc.RpcError:
            pass  # cancelled by close()

    def next(self, timeout_s: float = 10.0) -> pb.KVEventBatch:
        try:
            return self.batches.get(timeout=timeout_s)
        except queue.Empty:
            pytest.fail(f"no KV event batch within {timeout_s} s")

    def close(self) -> None:
        self.call.cancel()


def generate(worker: Worker, rid: str, prompt: list[int]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    request = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params))
    responses = list(worker.stub.Generate(request, metadata=MD, timeout=30))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


def prompt_of(seed: int, num_tokens: int = 3 * BLOCK_SIZE) -> list[int]:
    rng = random.Random(seed)
    return [20 + seed, *(rng.randrange(2, 128) for _ in range(num_tokens - 1))]  # a first token of its own


def snapshot(worker: Worker) -> list[bytes]:
    subscription = Subscription(worker.stub)
    try:
        first = subscription.next()
    finally:
        subscription.close()
    assert first.snapshot and not first.removed
    return list(first.stored)


def test_first_batch_is_the_snapshot_then_stored_blocks_come_as_deltas(worker: Worker) -> None:
    warm_up = worker.hashes(WARM_UP_PROMPT)
    subscription = Subscription(worker.stub)
    try:
        first = subscription.next()
        assert first.snapshot and list(first.stored) == warm_up and not first.removed

        prompt = prompt_of(1, 3 * BLOCK_SIZE + 5)  # three full blocks and a partial tail (not hashed)
        generate(worker, "stored", prompt)
        want = worker.hashes(prompt)
        assert len(want) == 3
        stored: list[bytes] = []
        while len(stored) < len(want):
            batch = subscription.next()
            assert not batch.snapshot and not batch.removed, "only stores: the cache has room"
            stored.extend(batch.stored)
        assert stored == want
    finally:
        subscription.close()
    assert sorted(snapshot(worker)) == sorted(warm_up + want)


def test_blocks_evicted_under_pressure_come_as_removed(worker: Worker) -> None:
    subscription = Subscription(worker.stub)
    try:
        first = subscription.next()
        assert first.snapshot
        held = set(first.stored)
        oldest = worker.hashes(WARM_UP_PROMPT)[0]
        assert oldest in held
        prompts = [prompt_of(seed) for seed in range(10, 16)]  # 6 x 4 blocks through a 16-block cache
        for i, prompt in enumerate(prompts):
            generate(worker, f"pressure-{i}", prompt)
        truth = set(snapshot(worker))
        assert set(worker.hashes(prompts[-1])) <= truth
        removed: list[bytes] = []
        deadline = time.monotonic() + 10
        while held != truth:  # replay the deltas: removed first, then stored, as worker.proto says
            if time.monotonic() > deadline:
                pytest.fail(f"the deltas never added up to the snapshot: {len(held)} vs {len(truth)}")
            batch = subscription.next()
            assert not batch.snapshot
            for block_hash in batch.removed:
                assert block_hash in held, "a removed hash that was never stored"
                held.discard(block_hash)
                removed.append(block_hash)
            held.update(batch.stored)
        assert removed and removed[0] == oldest, "the least recently used block goes first"
        everything = {h for p in prompts for h in worker.hashes(p)}
        assert set(removed) & everything, "blocks stored during the pressure were evicted too"
    finally:
        subscription.close()
