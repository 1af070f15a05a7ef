"""The router's /metrics: routing reasons, disaggregation decisions and per-replica state."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "router-metrics-token"
MD = (("authorization", f"Bearer {TOKEN}"),)


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_router_counts_routes_and_decisions(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8")
    worker_address, router_address = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    metrics_port = free_port()
    worker = Proc(
        ["worker", "--model", str(model), "--port", worker_address.split(":")[1], "--threads", "1"],
        env,
        tmp_path / "worker.log",
    )
    router = Proc(
        [
            "router",
            "--port",
            router_address.split(":")[1],
            "--workers",
            worker_address,
            "--metrics-port",
            str(metrics_port),
        ],
        env,
        tmp_path / "router.log",
    )
    try:
        wait_serving(worker_address, worker)
        wait_serving(router_address, router)
        with grpc.insecure_channel(router_address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for i in range(3):
                params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
                request = pb.GenerateRequest(
                    request_id=f"r{i}", prompt_token_ids=[5, 6, 7, 8 + i], sampling=sampling_to_proto(params)
                )
                list(stub.Generate(request, metadata=MD, timeout=30))
        got = scrape(metrics_port)
    finally:
        router.stop()
        worker.stop()
    routes = sum(v for (name, _), v in got.items() if name == "kvrelay_router_routes_total")
    assert routes == 3
    local = got[("kvrelay_router_disaggregation_decisions_total",
                 frozenset({("decision", "local"), ("reason", "no_prefill_pool")}))]  # fmt: skip
    assert local == 3
    assert (
        got[("kvrelay_router_replica_usable", frozenset({("replica", "worker-0"), ("role", "colocated")}))]
        == 1
    )
    assert got[("kvrelay_router_retries_total", frozenset())] == 0
