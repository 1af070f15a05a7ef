"""Internal mutual TLS: a worker and a router that require client certificates talk to each other, and
a client without a certificate signed by the CA gets nothing."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.stack_helpers import Proc, free_port, stack_env
from tests.tiny_model import make_tiny_llama
from tests.tls_certs import Certs, make_certs

TOKEN = "tls-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)


def secure_channel(address: str, certs: Certs) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.key.read_bytes(),
        certificate_chain=certs.cert.read_bytes(),
    )
    return grpc.secure_channel(address, credentials)


def wait_serving_tls(address: str, certs: Certs, proc: Proc) -> None:
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + 120
    with secure_channel(address, certs) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.popen.poll() is None, proc.log()[-3000:]
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(proc.log()[-3000:])


def test_router_and_worker_speak_mutual_tls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    model = make_tiny_llama(tmp_path / "tiny")
    env = stack_env(
        TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8", **certs.env()
    )
    worker_address, router_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    worker = Proc(
        ["worker", "--model", str(model), "--port", worker_address.split(":")[1], "--threads", "1"],
        env,
        tmp_path / "worker.log",
    )
    router = Proc(
        ["router", "--port", router_address.split(":")[1], "--workers", worker_address],
        env,
        tmp_path / "router.log",
    )
    try:
        wait_serving_tls(worker_address, certs, worker)
        wait_serving_tls(router_address, certs, router)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        request = pb.GenerateRequest(
            request_id="t1", prompt_token_ids=[4, 5, 6], sampling=sampling_to_proto(params)
        )
        with secure_channel(router_address, certs) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            tokens = [t for r in stub.Generate(request, metadata=MD, timeout=60) for t in r.token_ids]
        assert len(tokens) == 6
        stranger = make_certs(tmp_path / "other-ca", "stranger")  # signed by another CA
        for creds in (stranger, None):
            channel = (
                secure_channel(router_address, stranger) if creds else grpc.insecure_channel(router_address)
            )
            with channel, pytest.raises(grpc.RpcError) as err:
                worker_pb2_grpc.WorkerStub(channel).Info(pb.InfoRequest(), metadata=MD, timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        router.stop()
        worker.stop()


def test_kv_transfer_runs_over_mutual_tls(tmp_path: Path) -> None:
    certs = make_certs(tmp_path / "certs")
    model = make_tiny_llama(tmp_path / "tiny")
    env = stack_env(
        TOKEN,
        KVRELAY_MODEL__DTYPE="float32",
        KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8",
        KVRELAY_DISAGGREGATION__POLICY="always",
        **certs.env(),
    )
    addresses = {role: f"127.0.0.1:{free_port()}" for role in ("prefill", "decode")}
    workers = {
        role: Proc(
            [
                "worker",
                "--model",
                str(model),
                "--role",
                role,
                "--port",
                address.split(":")[1],
                "--threads",
                "1",
            ],
            env,
            tmp_path / f"{role}.log",
        )
        for role, address in addresses.items()
    }
    router_address = f"127.0.0.1:{free_port()}"
    router = Proc(
        ["router", "--port", router_address.split(":")[1], "--workers", ",".join(addresses.values())],
        env,
        tmp_path / "router.log",
    )
    try:
        for role, proc in workers.items():
            wait_serving_tls(addresses[role], certs, proc)
        wait_serving_tls(router_address, certs, router)
        with secure_channel(router_address, certs) as channel:
            status = worker_pb2_grpc.RouterStub(channel)
            deadline = time.monotonic() + 30
            while sum(r.ready for r in status.Replicas(pb.ReplicasRequest(), metadata=MD).replicas) < 2:
                if time.monotonic() > deadline:
                    pytest.fail("the router did not see both workers ready over TLS within 30 s")
                time.sleep(0.1)
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            request = pb.GenerateRequest(
                request_id="pd", prompt_token_ids=list(range(3, 60)), sampling=sampling_to_proto(params)
            )
            responses = list(worker_pb2_grpc.WorkerStub(channel).Generate(request, metadata=MD, timeout=60))
        assert sum(len(r.token_ids) for r in responses) == 6
        assert responses[-1].prefill_mode == pb.PREFILL_MODE_REMOTE and responses[-1].kv_transfer_bytes > 0
    finally:
        for proc in [router, *workers.values()]:
            proc.stop()
