"""A decode replica dying in disaggregated mode (docs/disaggregation.md, Failures): one prefill worker
(P), three decode workers and a router, as real processes on a tiny random-weight model.

- D dies while P is still prefilling for it: no token went out, so the router retries on another decode
  replica and the client sees a whole answer; P aborts the orphaned prefill (its peer's call is gone).
- D dies mid-stream: the client's stream ends with an error (UNAVAILABLE), not a hang; P holds nothing;
  the router ejects D and new requests succeed on the others, still prefilled on P.
- The link between D and P partitioned (a proxy that goes silent) while P prefills for D: the request
  ends on its own, whole or with UNAVAILABLE, and neither side holds anything.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.fault_proxy import BLACKHOLE, FaultProxy
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_wide_tiny_llama

TOKEN = "decode-death-token"
MD = (("authorization", f"Bearer {TOKEN}"),)
DECODES = ("decode-0", "decode-1", "decode-2")


class Stack:
    def __init__(self, model: Path, logs: Path) -> None:
        env = stack_env(
            TOKEN,
            KVRELAY_MODEL__DTYPE="float32",
            KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="64",
            KVRELAY_DISAGGREGATION__POLICY="always",  # every request prefilled on P
        )
        self.addresses = {name: f"127.0.0.1:{free_port()}" for name in ("prefill", *DECODES)}
        self.workers = {
            name: Proc(
                [
                    "worker",
                    "--model",
                    str(model),
                    "--role",
                    name.split("-")[0],
                    "--name",
                    name,
                    "--port",
                    address.split(":")[1],
                    "--threads",
                    "1",
                ],
                env,
                logs / f"{name}.log",
            )
            for name, address in self.addresses.items()
        }
        self.router_address = f"127.0.0.1:{free_port()}"
        self.router = Proc(
            [
                "router",
                "--port",
                self.router_address.split(":")[1],
                "--workers",
                ",".join(self.addresses.values()),
            ],
            env,
            logs / "router.log",
        )
        self.channels = {
            name: grpc.insecure_channel(address)
            for name, address in [*self.addresses.items(), ("router", self.router_address)]
        }
        for name, proc in self.workers.items():
            wait_serving(self.addresses[name], proc)
        wait_serving(self.router_address, self.router)
        self.wait_until(
            lambda: sorted(r.role for r in self.replicas() if r.ready) == ["decode"] * 3 + ["prefill"],
            "the router never saw the prefill and three decode replicas ready",
        )

    def stub(self, name: str) -> worker_pb2_grpc.WorkerStub:
        return worker_pb2_grpc.WorkerStub(self.channels[name])

    def load(self, name: str) -> pb.LoadResponse:
        return self.stub(name).Load(pb.LoadRequest(), metadata=MD, timeout=5)

    def replicas(self) -> list[pb.Replica]:
        status = worker_pb2_grpc.RouterStub(self.channels["router"])
        return list(status.Replicas(pb.ReplicasRequest(), metadata=MD, timeout=5).replicas)

    def ready_addresses(self) -> set[str]:
        return {r.address for r in self.replicas() if r.ready}

    def kill(self, name: str) -> None:
        self.workers[name].popen.kill()
        self.workers[name].popen.wait()

    def live_decodes(self) -> list[str]:
        return [name for name in DECODES if self.workers[name].popen.poll() is None]

    def decode_running(self, alive: list[str]) -> str | None:
        """The live decode replica holding a request now, if any."""
        return next((name for name in alive if self.load(name).running >= 1), None)

    @staticmethod
    def wait_until(condition: Callable[[], object], what: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"{what} (within {timeout_s} s)")
            time.sleep(0.05)

    def wait_idle(self, name: str) -> pb.LoadResponse:
        loads: list[pb.LoadResponse] = []

        def idle() -> bool:
            loads.append(self.load(name))
            return loads[-1].running == loads[-1].waiting == loads[-1].kv_blocks.active == 0

        self.wait_until(idle, f"{name} still holds work: {loads[-1] if loads else None}", 30.0)
        return loads[-1]

    def stop(self) -> None:
        for channel in self.channels.values():
            channel.close()
        for proc in [self.router, *self.workers.values()]:
            proc.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Wide enough that a 3000-token prefill takes a while on one thread, small enough to load at once.
    model = make_wide_tiny_llama(tmp_path_factory.mktemp("tiny"))
    running = Stack(model, tmp_path_factory.mktemp("decode-death-logs"))
    yield running
    running.stop()


def request(rid: str, prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params))


def prompt_of(seed: int, num_tokens: int) -> list[int]:
    rng = random.Random(seed)
    return [2 + seed, *(rng.randrange(2, 128) for _ in range(num_tokens - 1))]


def run(stub: worker_pb2_grpc.WorkerStub, rid: str, prompt: list[int], max_tokens: int
        ) -> tuple[list[int], pb.GenerateResponse]:  # fmt: skip
    tokens: list[int] = []
    last = pb.GenerateResponse()
    for response in stub.Generate(request(rid, prompt, max_tokens), metadata=MD, timeout=120):
        tokens.extend(response.token_ids)
        last = response
    return tokens, last


def test_a_partition_between_decode_and_prefill_ends_the_request_cleanly_and_frees_both(
    stack: Stack, tmp_path: Path
) -> None:
    """A second router that reaches P through a proxy, so its decode replicas pull KV through it too; the
    link cut silently (no FIN, no RST) while P computes a prompt for one of them. Before any token went
    out, the request must end on its own in bounded time, whole (a retry, or the decode replica prefilling
    locally) or with UNAVAILABLE, and neither side holds a request or a KV block: P's export, sent into
    the silence or aborted once its keepalive finds the peer gone, is released."""
    proxy = FaultProxy(int(stack.addresses["prefill"].split(":")[1]))
    address = f"127.0.0.1:{free_port()}"
    upstreams = ",".join([f"127.0.0.1:{proxy.port}", *(stack.addresses[name] for name in DECODES)])
    env = stack_env(TOKEN, KVRELAY_DISAGGREGATION__POLICY="always")
    router = Proc(
        ["router", "--port", address.split(":")[1], "--workers", upstreams], env, tmp_path / "r.log"
    )
    channel = grpc.insecure_channel(address)
    try:
        wait_serving(address, router)
        status = worker_pb2_grpc.RouterStub(channel)
        stack.wait_until(
            lambda: sum(r.ready for r in status.Replicas(pb.ReplicasRequest(), metadata=MD).replicas) == 4,
            "the second router never saw P (through the proxy) and the decode replicas ready",
        )
        stack.wait_idle("prefill")
        result: dict[str, tuple[list[int], pb.GenerateResponse] | grpc.RpcError] = {}

        def client() -> None:
            try:
                result["r"] = run(worker_pb2_grpc.WorkerStub(channel), "cut-pd", prompt_of(3, 3000), 8)
            except grpc.RpcError as exc:
                result["r"] = exc

        thread = threading.Thread(target=client)
        thread.start()
        alive = stack.live_decodes()
        stack.wait_until(
            lambda: stack.load("prefill").running > 0 and stack.decode_running(alive) is not None,
            "P never prefilled for a decode replica",
        )
        proxy.mode = BLACKHOLE
        thread.join(120)
        assert not thread.is_alive(), "the request hung past the partition"
        outcome = result["r"]
        if isinstance(outcome, grpc.RpcError):  # UNAVAILABLE from keepalive, not the call's DEADLINE_EXCEEDED
            assert outcome.code() == grpc.StatusCode.UNAVAILABLE, outcome.details()
        else:
            tokens, last = outcome
            assert len(tokens) == 8 and last.finish_reason == pb.FINISH_REASON_LENGTH
        stack.wait_idle("prefill")  # P finished or aborted the prefill whose peer went silent: holds nothing
        for name in alive:
            stack.wait_idle(name)
    finally:
        proxy.close()
        channel.close()
        router.stop()


def test_decode_dying_during_the_remote_prefill_is_retried_and_p_aborts_the_orphan(stack: Stack) -> None:
    before = stack.wait_idle("prefill")
    result: dict[str, tuple[list[int], pb.GenerateResponse] | BaseException] = {}

    def client() -> None:
        try:
            result["r"] = run(stack.stub("router"), "orphan", prompt_of(1, 3000), 8)
        except BaseException as exc:  # reported below
            result["r"] = exc

    thread = threading.Thread(target=client)
    thread.start()
    alive = stack.live_decodes()
    victim: list[str] = []

    def prefilling_for_a_decode() -> bool:  # D holds the reservation while P computes the prompt
        if stack.load("prefill").running == 0:
            return False
        found = stack.decode_running(alive)
        if found is not None:
            victim.append(found)
        return found is not None

    stack.wait_until(prefilling_for_a_decode, "P never prefilled for a decode replica")
    stack.kill(victim[0])
    thread.join(120)
    outcome = result.get("r")
    assert isinstance(outcome, tuple), f"the retried request failed: {outcome!r}"
    tokens, last = outcome
    assert len(tokens) == 8 and last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.prefill_mode in (pb.PREFILL_MODE_REMOTE, pb.PREFILL_MODE_FALLBACK)
    after = stack.wait_idle("prefill")
    assert after.requests_aborted_total == before.requests_aborted_total + 1, (
        "P must abort the prefill whose decode replica died"
    )


def test_decode_dying_mid_stream_fails_the_stream_and_new_requests_go_to_the_others(stack: Stack) -> None:
    stack.wait_idle("prefill")
    alive = stack.live_decodes()
    assert len(alive) >= 2
    served = {name: stack.load(name).requests_total for name in alive}
    call = stack.stub("router").Generate(request("doomed", prompt_of(2, 40), 3000), metadata=MD, timeout=60)
    responses = iter(call)
    first = next(responses)
    assert first.token_ids
    holders = [name for name in alive if stack.load(name).requests_total > served[name]]
    assert len(holders) == 1, f"the stream went to {holders}"
    victim = holders[0]
    assert stack.load(victim).running == 1, "the stream is not decoding on its replica"
    stack.kill(victim)
    with pytest.raises(grpc.RpcError) as failed:
        for _ in responses:
            pass
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()

    stack.wait_idle("prefill")
    dead = stack.addresses[victim]
    stack.wait_until(lambda: dead not in stack.ready_addresses(), "the router still uses the dead replica")
    survivors = [name for name in alive if name != victim]
    before = {name: stack.load(name).remote_prefills_total for name in survivors}
    for i in range(2):
        tokens, last = run(stack.stub("router"), f"after-{i}", prompt_of(10 + i, 40), 6)
        assert len(tokens) == 6 and last.prefill_mode == pb.PREFILL_MODE_REMOTE
    after = {name: stack.load(name).remote_prefills_total for name in survivors}
    assert sum(after.values()) - sum(before.values()) == 2, "the survivors took the new requests"
