"""A worker's /metrics: engine, KV and transfer series, labelled with its role and name."""

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

TOKEN = "metrics-token-0123456789"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_worker_exports_engine_and_kv_metrics(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "tiny")
    port, metrics_port = free_port(), free_port()
    env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8")
    proc = Proc(
        [
            "worker",
            "--model",
            str(model),
            "--port",
            str(port),
            "--threads",
            "1",
            "--name",
            "w7",
            "--metrics-port",
            str(metrics_port),
        ],
        env,
        tmp_path / "worker.log",
    )
    try:
        wait_serving(f"127.0.0.1:{port}", proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
            request = pb.GenerateRequest(
                request_id="m1", prompt_token_ids=[3, 4, 5, 6] * 10, sampling=sampling_to_proto(params)
            )
            stub = worker_pb2_grpc.WorkerStub(channel)
            auth = (("authorization", f"Bearer {TOKEN}"),)
            list(stub.Generate(request, metadata=auth))
            info = stub.Info(pb.InfoRequest(), metadata=auth)
            load = stub.Load(pb.LoadRequest(), metadata=auth)
        got = samples(httpx.get(f"http://127.0.0.1:{metrics_port}/metrics").text)
    finally:
        proc.stop()
    labels = (("role", "colocated"), ("worker", "w7"))
    assert got[("kvrelay_engine_step_seconds_count", labels)] >= 5 + 1  # warm-up plus ours
    assert got[("kvrelay_queue_time_seconds_count", labels)] >= 2
    assert got[("kvrelay_worker_running_requests", labels)] == 0
    assert got[("kvrelay_kv_blocks", tuple(sorted((*labels, ("state", "active")))))] == 0
    assert got[("kvrelay_kv_blocks", tuple(sorted((*labels, ("state", "cached")))))] >= 2  # our full blocks
    assert got[("kvrelay_worker_prefix_cache_query_tokens_total", labels)] >= 40
    assert ("kvrelay_kv_transfer_bytes_total", labels) in got
    # fp32 safetensors: every step here (16 or 40 prompt tokens, decode) is small, so the C kernels ran it
    kernels = got[("kvrelay_engine_steps_total", tuple(sorted((*labels, ("path", "kernels")))))]
    assert kernels >= 5 + 1
    assert got[("kvrelay_engine_steps_total", tuple(sorted((*labels, ("path", "gemm")))))] == 0
    assert dict(load.steps_by_path) == {"kernels": kernels, "gemm": 0}
    assert (info.weights, info.small_step_max_tokens) == ("safetensors", 64)
    assert info.small_step_source == "the model family's default"
    assert got[("kvrelay_model_weight_bytes", labels)] == info.weight_bytes > 0
