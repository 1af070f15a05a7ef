"""Graceful drain under load: SIGTERM to one of two workers fails no request (its in-flight streams
finish within the grace period) and the router sends nothing new to it once it is draining."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import grpc

from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "drain-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)


def test_sigterm_under_load_fails_nothing_and_gets_no_new_work(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8")
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    workers = [
        Proc(
            [
                "worker",
                "--model",
                str(model),
                "--port",
                a.split(":")[1],
                "--threads",
                "1",
                "--name",
                f"w{i}",
                "--grace-seconds",
                "60",
            ],
            env,
            tmp_path / f"w{i}.log",
        )
        for i, a in enumerate(addresses)
    ]
    router_address = f"127.0.0.1:{free_port()}"
    router = Proc(
        ["router", "--port", router_address.split(":")[1], "--workers", ",".join(addresses)],
        env,
        tmp_path / "router.log",
    )
    outcomes: list[str] = []
    stop = threading.Event()
    try:
        for proc, address in [*zip(workers, addresses, strict=True), (router, router_address)]:
            wait_serving(address, proc)
        channel = grpc.insecure_channel(router_address)
        stub = worker_pb2_grpc.WorkerStub(channel)
        # The router must know both workers before the drain: a request the draining worker refuses is
        # retried on the other one, which would otherwise not be there to take it yet.
        replicas = worker_pb2_grpc.RouterStub(channel)
        deadline = time.monotonic() + 60
        while [r.ready for r in replicas.Replicas(pb.ReplicasRequest(), metadata=MD).replicas] != [True] * 2:
            assert time.monotonic() < deadline, "the router did not see both workers ready within 60 s"
            time.sleep(0.05)

        def client(c: int) -> None:
            i = 0
            while not stop.is_set():
                params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
                request = pb.GenerateRequest(
                    request_id=f"c{c}-{i}",
                    prompt_token_ids=[3 + c, 4, 5 + i % 50],
                    sampling=sampling_to_proto(params),
                )
                try:
                    n = sum(len(r.token_ids) for r in stub.Generate(request, metadata=MD, timeout=120))
                    outcomes.append("ok" if n == 120 else f"short {n}")
                except grpc.RpcError as exc:
                    outcomes.append(exc.code().name)
                i += 1

        threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for thread in threads:
            thread.start()
        load = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(addresses[0]))
        deadline = time.monotonic() + 60
        while load.Load(pb.LoadRequest(), metadata=MD).running == 0:  # SIGTERM it while it has work
            assert time.monotonic() < deadline, "no request reached the first worker within 60 s"
            time.sleep(0.05)
        draining_total = load.Load(pb.LoadRequest(), metadata=MD).requests_total
        workers[0].popen.send_signal(signal.SIGTERM)
        assert workers[0].popen.wait(90) == 0, workers[0].log()[-2000:]
        time.sleep(2.0)  # keep traffic flowing on the survivor for a while
        stop.set()
        for thread in threads:
            thread.join(150)
        channel.close()
    finally:
        stop.set()
        for proc in [router, *workers]:
            proc.stop()
    assert outcomes and set(outcomes) == {"ok"}, sorted(set(outcomes))
    drained_log = workers[0].log()
    assert "worker draining" in drained_log
    # Every request the draining worker took was already running when SIGTERM came: nothing new after.
    finished_on_w0 = drained_log.count('"msg": "generate done"')
    assert finished_on_w0 <= draining_total + 4, (finished_on_w0, draining_total)
