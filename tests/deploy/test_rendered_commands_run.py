"""The chart's containers, run for real: each rendered container's command, arguments and environment
start the real `kvrelay` CLI here, and the probes the chart declares for it answer healthy.

The chart is rendered (CPU workers, one thread each, the model fingerprint pinned) and the codec,
router, prefill and decode Deployments' containers, and their verify-model init containers, run as
local processes. Only what a pod gets from its surroundings is substituted, each in one place below:

- volumes: each volumeMount's mountPath becomes a local directory with what the volume would hold:
  the ConfigMap's config.yaml, the internal-token Secret's file (a fresh token), the model volume (the
  prepared model's parent directory, so /models/<model.version> is models/<model.version>), /tmp;
- listen addresses: `--host 0.0.0.0` becomes 127.0.0.1, and each declared containerPort (in the
  arguments and the probes) a free loopback port of its own per pod;
- cluster DNS: `<service>:<port>` and redis://<service>:<port> become the loopback port of the pod the
  Service targets (Redis: a redis-server started here when one is installed);
- the downward API: POD_NAME and POD_NAMESPACE get a pod name and the release namespace;
- the image's entrypoints: `kvrelay` is this checkout's CLI (`python -m services.cli.main`),
  `kvrelay-verify-model` is deploy/docker/kvrelay-verify-model, run by this Python;
- Kubernetes API access: the router keeps its `--discovery kubernetes --namespace --selector --port-name`
  flags and gets one more, `--kubeconfig`, naming the stand-in API server (tests/k8s_stand_in.py), which
  serves the worker Services' EndpointSlices as the EndpointSlice controller would (labelled with
  kubernetes.io/service-name, the Service's port name, the pods' addresses, ready).

Then every startup probe must pass, then every readiness and liveness probe, a chat completion must go
through the codec, and SIGTERM must stop every process cleanly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy import chart
from tests.deploy.chart import NAMESPACE, deployment, find, fullname, one
from tests.k8s_stand_in import K8sStandIn
from tests.stack_helpers import REPO_ROOT, free_port

pytestmark = pytest.mark.model

START_TIMEOUT_S = 75.0
CLI = [sys.executable, "-m", "services.cli.main"]
ENTRYPOINTS = {
    "kvrelay": CLI,
    "kvrelay-verify-model": [sys.executable, str(REPO_ROOT / "deploy" / "docker" / "kvrelay-verify-model")],
}


def run_values(model_dir: Path) -> dict[str, Any]:
    fingerprint = json.loads((model_dir / "manifest.json").read_text())["model_fingerprint"]
    return {
        "gpu": {"enabled": False},
        "model": {"version": model_dir.name, "fingerprint": fingerprint},
        "prefill": {"threads": 1, "replicas": 1},
        "decode": {"threads": 1, "replicas": 1},
        "config": {"engine": {"kv_cache_memory_mb": 512}},
    }


@dataclass
class LocalPod:
    """One rendered pod as local processes: its volumes, ports and environment made local."""

    stage: str
    deployment: dict
    workdir: Path
    ports: dict[int, int] = field(default_factory=dict)  # containerPort -> local port
    mounts: dict[str, Path] = field(default_factory=dict)  # mountPath -> local directory
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    @property
    def name(self) -> str:
        return f"{self.deployment['metadata']['name']}-0"

    @property
    def spec(self) -> dict:
        return self.deployment["spec"]["template"]["spec"]

    @property
    def container(self) -> dict:
        (ctr,) = self.spec["containers"]
        return ctr

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""


class Cluster:
    """Everything the pods expect around them, locally: volumes' contents, Services, an API server."""

    def __init__(self, objects: list[dict], model_dir: Path, root: Path) -> None:
        self.objects = objects
        self.model_dir = model_dir
        self.root = root
        self.token = "rendered-commands-token"
        self.pods: dict[str, LocalPod] = {}
        self.redis: subprocess.Popen | None = None
        self.redis_port = free_port()
        self.api = K8sStandIn().start()
        self.stopped = False
        self.kubeconfig = self.api.write_kubeconfig(root / "kubeconfig", NAMESPACE)

    # -- volumes -------------------------------------------------------------------------------------

    def volume_dir(self, pod: LocalPod, volume: dict) -> Path | None:
        """A local directory holding what this pod volume would hold; None for ones not needed here."""
        name = volume["name"]
        if "configMap" in volume:
            cm = one(self.objects, "ConfigMap", volume["configMap"]["name"])
            path = self.root / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            for key, text in cm["data"].items():
                (path / key).write_text(text)
            return path
        if "secret" in volume:
            assert volume["secret"]["secretName"] == chart.fullname("internal-token"), volume
            (secret,) = find(self.objects, "Secret")  # the chart-made token Secret
            path = self.root / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            for key in secret["data"]:
                (path / key).write_text(self.token)
            return path
        if name == "model":
            assert volume["persistentVolumeClaim"]["readOnly"] is True
            return self.model_dir.parent
        if "emptyDir" in volume:
            if volume["emptyDir"].get("medium") == "Memory":
                return None  # /dev/shm
            path = pod.workdir / name
            path.mkdir(parents=True, exist_ok=True)
            return path
        raise AssertionError(f"unexpected volume {volume}")

    def make_pod(self, stage: str) -> LocalPod:
        d = deployment(self.objects, stage)
        pod = LocalPod(stage, d, self.root / stage)
        pod.workdir.mkdir(parents=True)
        volumes = {v["name"]: v for v in pod.spec["volumes"]}
        for ctr in [*(pod.spec.get("initContainers") or []), pod.container]:
            for mount in ctr.get("volumeMounts") or []:
                local = self.volume_dir(pod, volumes[mount["name"]])
                if local is not None:
                    pod.mounts[mount["mountPath"]] = local
            for port in ctr.get("ports") or []:
                pod.ports.setdefault(port["containerPort"], free_port())
        self.pods[stage] = pod
        return pod

    # -- Services ------------------------------------------------------------------------------------

    def service_address(self, service: str, port: int) -> str:
        """`<service>:<port>` as the loopback address of the pod behind it."""
        if service == chart.fullname("redis"):
            return f"127.0.0.1:{self.redis_port}"
        svc = one(self.objects, "Service", service)
        svc_port = next(p for p in svc["spec"]["ports"] if p["port"] == port)
        pod = next(
            p
            for p in self.pods.values()
            if svc["spec"]["selector"].items()
            <= p.deployment["spec"]["template"]["metadata"]["labels"].items()
        )
        target = svc_port["targetPort"]
        number = next(cp["containerPort"] for cp in pod.container["ports"] if cp["name"] == target)
        return f"127.0.0.1:{pod.ports[number]}"

    def localize(self, pod: LocalPod, value: str) -> str:
        """Mount paths, Service addresses and Redis URLs in one argument or env value, made local."""
        for mount_path, local in sorted(pod.mounts.items(), key=lambda kv: -len(kv[0])):
            if value == mount_path or value.startswith(mount_path.rstrip("/") + "/"):
                return str(local) + value[len(mount_path.rstrip("/")) :]
        services = {s["metadata"]["name"] for s in find(self.objects, "Service")}
        match = re.fullmatch(r"(redis://)?([a-z0-9-]+):(\d+)(/.*)?", value)
        if match and match.group(2) in services:
            address = self.service_address(match.group(2), int(match.group(3)))
            return f"{match.group(1) or ''}{address}{match.group(4) or ''}"
        return value

    # -- commands ------------------------------------------------------------------------------------

    def environment(self, pod: LocalPod, ctr: dict) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
        env["PYTHONUNBUFFERED"] = "1"
        for item in ctr.get("env") or []:
            if "value" in item:
                env[item["name"]] = self.localize(pod, item["value"])
                continue
            field_path = item["valueFrom"]["fieldRef"]["fieldPath"]
            env[item["name"]] = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE}[field_path]
        return env

    def command(self, pod: LocalPod, ctr: dict, env: dict[str, str]) -> list[str]:
        args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in ctr.get("args") or []]
        out: list[str] = []
        for i, arg in enumerate(args):
            previous = args[i - 1] if i else ""
            if previous == "--host" and arg == "0.0.0.0":
                out.append("127.0.0.1")
            elif previous.startswith("--") and previous.endswith("port") and arg.isdigit():
                out.append(str(pod.ports[int(arg)]))  # a declared containerPort, made a free port
            else:
                out.append(self.localize(pod, arg))
        if "--discovery" in out and out[out.index("--discovery") + 1] == "kubernetes":
            out += ["--kubeconfig", str(self.kubeconfig)]  # in-cluster credentials -> the stand-in
        return ENTRYPOINTS[ctr["command"][0]] + ctr["command"][1:] + out

    def run_init_containers(self, pod: LocalPod) -> None:
        for ctr in pod.spec.get("initContainers") or []:
            env = self.environment(pod, ctr)
            result = subprocess.run(
                self.command(pod, ctr, env),
                env=env,
                cwd=pod.workdir,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert result.returncode == 0, f"{pod.stage} init container {ctr['name']}: {result.stderr}"

    def start(self, pod: LocalPod) -> None:
        env = self.environment(pod, pod.container)
        pod.log_path = pod.workdir / "log.txt"
        with pod.log_path.open("wb") as log:
            pod.proc = subprocess.Popen(
                self.command(pod, pod.container, env),
                env=env,
                cwd=pod.workdir,  # the image's WORKDIR; nothing may depend on the checkout's
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def publish_endpoint_slices(self) -> None:
        """What the EndpointSlice controller would publish for each headless worker Service."""
        for stage in ("prefill", "decode"):
            svc = one(self.objects, "Service", fullname(stage))
            pod = self.pods[stage]
            grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
            number = next(
                cp["containerPort"] for cp in pod.container["ports"] if cp["name"] == grpc_port["targetPort"]
            )
            labels = {**svc["metadata"]["labels"], "kubernetes.io/service-name": svc["metadata"]["name"]}
            endpoint = {
                "addresses": ["127.0.0.1"],
                "conditions": {"ready": True, "serving": True, "terminating": False},
                "targetRef": {"kind": "Pod", "name": pod.name, "namespace": NAMESPACE},
            }
            self.api.put_slice(
                f"{svc['metadata']['name']}-x7k2p",
                [endpoint],
                labels,
                port=pod.ports[number],
                port_name=grpc_port["name"],
                namespace=NAMESPACE,
            )

    def start_redis(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            return  # the codec connects lazily: its probes do not need Redis
        self.redis = subprocess.Popen(
            [
                server,
                "--port",
                str(self.redis_port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every process (front to back), wait for each, then stop Redis and the API server."""
        codes: dict[str, int | None] = {}
        if self.stopped:
            return codes
        self.stopped = True
        for stage in ("codec", "router", "decode", "prefill"):  # front to back, as a rollout would
            pod = self.pods.get(stage)
            if pod is None or pod.proc is None:
                continue
            if pod.proc.poll() is None:
                pod.proc.send_signal(signal.SIGTERM)
            try:
                codes[stage] = pod.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(pod.proc.pid, signal.SIGKILL)
                pod.proc.wait()
                codes[stage] = None
        if self.redis is not None:
            self.redis.terminate()
            self.redis.wait(10)
        self.api.stop()
        return codes


# -- probes, as the kubelet runs them ------------------------------------------------------------------


def probe_ok(pod: LocalPod, probe: dict) -> bool:
    def port_of(port: int | str) -> int:
        return pod.ports[chart.container_port(pod.container, port)]

    timeout = float(probe.get("timeoutSeconds", 1))
    if "httpGet" in probe:
        url = f"http://127.0.0.1:{port_of(probe['httpGet']['port'])}{probe['httpGet']['path']}"
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(url, timeout=timeout) as response:
                return 200 <= response.status < 400
        except OSError:
            return False
    if "grpc" in probe:
        address = f"127.0.0.1:{port_of(probe['grpc']['port'])}"
        with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
            request = health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", ""))
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(request, timeout=timeout)
            except grpc.RpcError:
                return False
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    if "tcpSocket" in probe:
        try:
            socket.create_connection(
                ("127.0.0.1", port_of(probe["tcpSocket"]["port"])), timeout=timeout
            ).close()
            return True
        except OSError:
            return False
    raise AssertionError(f"unsupported probe {probe}")


def wait_probe(pod: LocalPod, kind: str, deadline: float) -> None:
    probe = pod.container[kind]
    while time.monotonic() < deadline:
        assert pod.proc is not None
        if pod.proc.poll() is not None:
            raise AssertionError(f"{pod.stage} exited with {pod.proc.returncode}:\n{pod.log()}")
        if probe_ok(pod, probe):
            return
        time.sleep(0.3)
    raise AssertionError(f"{pod.stage} {kind} {probe} never passed:\n{pod.log()}")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    objects = chart.render(run_values(model_dir))
    running = Cluster(objects, model_dir, tmp_path_factory.mktemp("pods"))
    running.start_redis()
    try:
        yield running
    finally:
        running.stop()


def test_rendered_containers_run_and_answer_their_probes(cluster: Cluster) -> None:
    started = time.monotonic()
    pods = {stage: cluster.make_pod(stage) for stage in ("prefill", "decode", "router", "codec")}
    for stage in ("codec", "decode"):  # tokenizer scope, model scope (prefill's is the same command)
        cluster.run_init_containers(pods[stage])
    cluster.publish_endpoint_slices()
    for pod in pods.values():
        cluster.start(pod)
    deadline = started + START_TIMEOUT_S
    for stage in ("router", "codec", "prefill", "decode"):
        wait_probe(pods[stage], "startupProbe", deadline)
    for stage in ("prefill", "decode", "router", "codec"):  # readiness flows from the back to the front
        wait_probe(pods[stage], "readinessProbe", deadline)
        wait_probe(pods[stage], "livenessProbe", deadline)

    # the router found both workers through the EndpointSlices, by the names of their pods
    assert cluster.api.list_calls and cluster.api.watch_calls
    selectors = {call["labelSelector"] for call in cluster.api.list_calls}
    assert selectors == {f"kubernetes.io/service-name={fullname(s)}" for s in ("prefill", "decode")}

    # the whole chain serves a request: codec -> router -> decode (-> prefill)
    codec_port = pods["codec"].ports[int(chart.arg_value(pods["codec"].container["args"], "--port"))]
    body = {
        "model": cluster.model_dir.name,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{codec_port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=60) as response:
        reply = json.loads(response.read())
    assert reply["usage"]["completion_tokens"] >= 1

    # every declared metrics port serves Prometheus text
    for stage in ("router", "prefill", "decode"):
        ports = {p["name"]: p["containerPort"] for p in pods[stage].container["ports"]}
        with opener.open(f"http://127.0.0.1:{pods[stage].ports[ports['metrics']]}/metrics", timeout=5) as r:
            assert b"kvrelay_" in r.read()

    # SIGTERM: every process drains and exits by itself. uvicorn re-raises the signal once its graceful
    # shutdown is done, so the codec ends "killed by SIGTERM" (exit 143 in a container) after finishing.
    codes = cluster.stop()
    logs = {s: p.log() for s, p in pods.items()}
    assert codes == {"codec": codes["codec"], "router": 0, "decode": 0, "prefill": 0}, logs
    assert codes["codec"] in (0, -signal.SIGTERM), logs["codec"]
    assert "Finished server process" in logs["codec"]
