"""A real router with `--discovery kubernetes`, pointed (through a kubeconfig) at the stand-in API server,
over two real colocated workers on a tiny random-weight model, under continuous traffic.

The EndpointSlice starts with decode-0; decode-1 is added (scale up): both are used. Then decode-0 is
marked terminating (it stops getting new requests while its in-flight ones finish) and removed (scale
down). No request fails at any point, and after the drain only decode-1 gets requests.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from services.common.manifest import load_verified_manifest
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.k8s_stand_in import K8sStandIn, slice_endpoint
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "k8s-discovery-token"
MD = (("authorization", f"Bearer {TOKEN}"),)
NAMESPACE = "serving"
LABELS = {"app.kubernetes.io/name": "kvrelay", "app.kubernetes.io/component": "decode"}
SELECTOR = "app.kubernetes.io/name=kvrelay,app.kubernetes.io/component=decode"
PODS = ("decode-0", "decode-1")
CLIENT_MAX_TOKENS = (
    16,
    16,
    3000,
)  # two short clients and a long one (~seconds), whose requests outlive a drain
LONG_REQUEST_BLOCKS = 8  # KV blocks in use on a worker that only a long request reaches (16 tokens each)


class Traffic:
    """Clients sending greedy Generate requests through the router, one after another, until stopped."""

    def __init__(self, router_address: str) -> None:
        self.channel = grpc.insecure_channel(router_address)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.ok = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(i, max_tokens))
            for i, max_tokens in enumerate(CLIENT_MAX_TOKENS)
        ]

    def start(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
        self.channel.close()

    def _client(self, client: int, max_tokens: int) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        n = 0
        while not self._stop.is_set():
            n += 1
            request = pb.GenerateRequest(
                request_id=f"c{client}-{n}",
                prompt_token_ids=[3, 5 + n % 50, 7, 11 + client],
                sampling=sampling_to_proto(params),
            )
            try:
                tokens = [
                    t for r in self.stub.Generate(request, metadata=MD, timeout=30) for t in r.token_ids
                ]
                outcome = "" if len(tokens) == max_tokens else f"{request.request_id}: {len(tokens)} tokens"
            except grpc.RpcError as exc:
                outcome = f"{request.request_id}: {exc.code()} {exc.details()}"
            with self._lock:
                if outcome:
                    self.failures.append(outcome)
                else:
                    self.ok += 1


class Cluster:
    """Two workers on one port at 127.0.0.1 and 127.0.0.2 (like two pods), the stand-in, and the router."""

    def __init__(self, model_dir: Path, tmp: Path) -> None:
        env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8")
        env.pop("KUBERNETES_SERVICE_HOST", None)  # the kubeconfig, not an in-cluster account
        port = free_port()
        self.addresses = {pod: f"127.0.0.{i + 1}:{port}" for i, pod in enumerate(PODS)}
        worker = ["worker", "--model", str(model_dir), "--port", str(port), "--threads", "1"]
        self.workers = {
            pod: Proc([*worker, "--host", address.split(":")[0], "--name", pod], env, tmp / f"{pod}.log")
            for pod, address in self.addresses.items()
        }
        self.api = K8sStandIn().start()
        self.put_endpoints([slice_endpoint(self.addresses["decode-0"], "decode-0")])
        kubeconfig = self.api.write_kubeconfig(tmp / "kubeconfig", namespace=NAMESPACE)
        self.router_address = f"127.0.0.1:{free_port()}"
        self.router_metrics_url = f"http://127.0.0.1:{free_port()}/metrics"
        router = ["router", "--port", self.router_address.split(":")[1], "--discovery", "kubernetes"]
        router += ["--metrics-port", self.router_metrics_url.split(":")[2].split("/")[0]]
        router += ["--selector", SELECTOR, "--kubeconfig", str(kubeconfig)]
        router += ["--model-fingerprint", load_verified_manifest(model_dir).model_fingerprint]
        self.router = Proc(router, env, tmp / "router.log")
        for pod, proc in self.workers.items():
            wait_serving(self.addresses[pod], proc)
        wait_serving(self.router_address, self.router)
        self.router_channel = grpc.insecure_channel(self.router_address)

    def put_endpoints(self, endpoints: list[dict]) -> None:
        self.api.put_slice("kvrelay-decode-x7k2p", endpoints, LABELS, namespace=NAMESPACE)

    def replicas(self) -> dict[str, bool]:
        """The router's replicas: name -> ready (takes new requests)."""
        stub = worker_pb2_grpc.RouterStub(self.router_channel)
        return {r.name: r.ready for r in stub.Replicas(pb.ReplicasRequest(), metadata=MD).replicas}

    def in_flight(self, pod: str) -> int:
        """Requests the router sent to `pod` and has not seen finish (its own count, from /metrics)."""
        text = httpx.get(self.router_metrics_url, timeout=5).text
        pattern = r'^kvrelay_router_replica_in_flight\{replica="' + re.escape(pod) + r'"[^}]*\} (\S+)$'
        found = re.search(pattern, text, re.MULTILINE)
        assert found is not None, f"no in-flight gauge for {pod} in the router's metrics"
        return int(float(found.group(1)))

    def load(self, pod: str) -> pb.LoadResponse:
        with grpc.insecure_channel(self.addresses[pod]) as channel:
            return worker_pb2_grpc.WorkerStub(channel).Load(pb.LoadRequest(), metadata=MD, timeout=5)

    def stop(self) -> None:
        self.router_channel.close()
        for proc in [self.router, *self.workers.values()]:
            proc.stop()
        self.api.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model_dir = make_tiny_llama(
        tmp_path_factory.mktemp("model") / "tiny", seed=0, max_position_embeddings=4096
    )
    c = Cluster(model_dir, tmp_path_factory.mktemp("cluster"))
    yield c
    c.stop()


def eventually(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.1)


def test_scaling_the_endpoint_slice_adds_and_drains_replicas_under_traffic(cluster: Cluster) -> None:
    assert cluster.replicas() == {"decode-0": True}
    assert cluster.api.watch_calls and cluster.api.watch_calls[0]["labelSelector"] == SELECTOR
    traffic = Traffic(cluster.router_address).start()
    try:
        eventually(lambda: traffic.ok >= 5, "requests served by decode-0")
        assert cluster.load("decode-1").requests_total == 0

        # Scale up: decode-1 joins the slice and starts taking requests.
        before = {pod: cluster.load(pod).requests_total for pod in PODS}
        cluster.put_endpoints([slice_endpoint(cluster.addresses[pod], pod) for pod in PODS])
        eventually(lambda: cluster.replicas() == {"decode-0": True, "decode-1": True}, "both replicas ready")
        eventually(
            lambda: all(cluster.load(pod).requests_total >= before[pod] + 3 for pod in PODS),
            "requests landing on both replicas",
        )

        # Scale down: decode-0 terminates while a long request runs there, then leaves the slice. It gets
        # no new requests from then on; the long request finishes, and the router then drops decode-0.
        eventually(
            lambda: cluster.load("decode-0").kv_blocks.active >= LONG_REQUEST_BLOCKS,
            "a long request in flight on decode-0",
        )
        terminating = slice_endpoint(
            cluster.addresses["decode-0"], "decode-0", ready=False, serving=True, terminating=True
        )
        cluster.put_endpoints([terminating, slice_endpoint(cluster.addresses["decode-1"], "decode-1")])
        eventually(lambda: cluster.replicas().get("decode-0") is False, "decode-0 draining")
        # A short request routed to decode-0 just before the change may not have reached it yet. Once
        # only the long request is left in flight there, every request routed to it has been counted.
        eventually(lambda: cluster.in_flight("decode-0") <= 1, "decode-0's short requests to finish")
        drained = cluster.load("decode-0").requests_total
        cluster.put_endpoints([slice_endpoint(cluster.addresses["decode-1"], "decode-1")])
        eventually(
            lambda: "replica left; draining" in cluster.router.log(), "the router seeing decode-0 leave"
        )
        assert cluster.load("decode-0").running > 0, "the long request should still be running on decode-0"
        assert cluster.replicas() == {"decode-0": False, "decode-1": True}  # kept until it finishes
        eventually(lambda: cluster.replicas() == {"decode-1": True}, "decode-0 dropped once idle")
        assert cluster.load("decode-0").running == 0
        ok_before = traffic.ok
        eventually(lambda: traffic.ok >= ok_before + 10, "requests served after the drain")
    finally:
        traffic.stop()
    assert traffic.failures == []
    assert cluster.load("decode-0").requests_total == drained  # nothing new once it was terminating
    assert cluster.load("decode-1").requests_total > before["decode-1"] + 10
    assert "replica removed" in cluster.router.log()
