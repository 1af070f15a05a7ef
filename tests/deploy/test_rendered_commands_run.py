"""The chart's containers, run for real: each rendered container's command, arguments and environment
start the real `kvrelay` CLI here, and the probes the chart declares for it answer healthy.

The chart is rendered (CPU workers, one thread each, the model fingerprint pinned, API keys from a
Secret) and the codec, router, prefill, decode and Redis Deployments' containers, and the verify-model
init containers, run as local processes. Only what a pod gets from its surroundings is substituted, each
in one place below:

- volumes: each volumeMount's mountPath becomes a local directory with what the volume would hold:
  the ConfigMap's config.yaml (the mount paths it names made local for the pod), the internal-token
  Secret's file (a fresh token), the API keys Secret's keys file (made here by `kvrelay keys add`), the
  model volume (the prepared model's parent directory, so /models/<model.version> is
  models/<model.version>), /tmp and Redis's /data;
- env from Secrets: the value the rendered Secret holds (the Redis password the chart generated), and
  `$(VAR)` in env values and arguments expanded from the env defined before it, as the kubelet does;
- listen addresses: `--host 0.0.0.0` becomes 127.0.0.1 (Redis gets `--bind 127.0.0.1`), and each
  declared containerPort (in the arguments, in `*PORT` env values and in the probes) a free loopback
  port of its own per pod;
- cluster DNS: `<service>:<port>` and redis://[:password@]<service>:<port> become the loopback port of
  the pod the Service targets;
- the downward API: POD_NAME and POD_NAMESPACE get a pod name and the release namespace;
- the image's entrypoints: `kvrelay` is this checkout's CLI (`python -m services.cli.main`),
  `kvrelay-verify-model` is deploy/docker/kvrelay-verify-model, run by this Python, `redis-server` the
  one installed here;
- Kubernetes API access: the router keeps its `--discovery kubernetes --namespace --selector --port-name`
  flags and gets one more, `--kubeconfig`, naming the stand-in API server (tests/k8s_stand_in.py), which
  serves the worker Services' EndpointSlices as the EndpointSlice controller would (labelled with
  kubernetes.io/service-name, the Service's port name, the pods' addresses, ready).

Then every startup probe must pass, then every readiness and liveness probe, a chat completion must go
through the codec with an API key (and be refused without one), every metrics port must serve, and
SIGTERM must stop every process cleanly.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy import chart
from tests.deploy.chart import KEYS_SECRET, NAMESPACE, deployment, find, fullname, one
from tests.k8s_stand_in import K8sStandIn
from tests.stack_helpers import REPO_ROOT, free_port

pytestmark = pytest.mark.model

START_TIMEOUT_S = 75.0
CLI = [sys.executable, "-m", "services.cli.main"]
REDIS_SERVER = shutil.which("redis-server")
ENTRYPOINTS = {
    "kvrelay": CLI,
    "kvrelay-verify-model": [sys.executable, str(REPO_ROOT / "deploy" / "docker" / "kvrelay-verify-model")],
    "redis-server": [REDIS_SERVER or "redis-server"],
}


def run_values(model_dir: Path) -> dict[str, Any]:
    fingerprint = json.loads((model_dir / "manifest.json").read_text())["model_fingerprint"]
    return {
        "gpu": {"enabled": False},
        "model": {"version": model_dir.name, "fingerprint": fingerprint},
        "prefill": {"threads": 1, "replicas": 1},
        "decode": {"threads": 1, "replicas": 1},
        # a limit, so each request is counted in the bundled Redis (fail-closed: a wrong password is a 503)
        "config": {"engine": {"kv_cache_memory_mb": 512}, "quotas": {"default_requests_per_minute": 600}},
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
        self.api_key, self.keys_file = make_api_key(root)
        self.pods: dict[str, LocalPod] = {}
        self.api = K8sStandIn().start()
        self.stopped = False
        self.kubeconfig = self.api.write_kubeconfig(root / "kubeconfig", NAMESPACE)

    # -- volumes -------------------------------------------------------------------------------------

    def volume_dir(self, pod: LocalPod, volume: dict) -> Path | None:
        """A local directory holding what this pod volume would hold; None for ones not needed here."""
        name = volume["name"]
        if "configMap" in volume:  # written by make_pod, once every mount of the pod is known
            path = pod.workdir / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            return path
        if "secret" in volume:
            path = self.root / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            secret_name = volume["secret"]["secretName"]
            if secret_name == KEYS_SECRET:  # an existing Secret: what `kvrelay keys add` wrote
                shutil.copy(self.keys_file, path / chart.BASE_VALUES["auth"].get("key", "keys.yaml"))
                return path
            assert secret_name == chart.fullname("internal-token"), volume
            for key in one(self.objects, "Secret", secret_name)["data"]:
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
        for volume in volumes.values():
            if "configMap" in volume:
                self.write_config_map(pod, volume)
        self.pods[stage] = pod
        return pod

    def write_config_map(self, pod: LocalPod, volume: dict) -> None:
        """The ConfigMap's files, each YAML string naming a path under a mount made local for `pod`."""

        def local(node: Any) -> Any:
            if isinstance(node, dict):
                return {k: local(v) for k, v in node.items()}
            if isinstance(node, list):
                return [local(v) for v in node]
            return self.localize(pod, node) if isinstance(node, str) else node

        cm = one(self.objects, "ConfigMap", volume["configMap"]["name"])
        for key, text in cm["data"].items():
            (pod.workdir / "volumes" / volume["name"] / key).write_text(
                yaml.safe_dump(local(yaml.safe_load(text)))
            )

    # -- Services ------------------------------------------------------------------------------------

    def service_address(self, service: str, port: int) -> str:
        """`<service>:<port>` as the loopback address of the pod behind it."""
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
        match = re.fullmatch(r"(rediss?://(?:[^@/]*@)?)?([a-z0-9-]+):(\d+)(/.*)?", value)
        if match and match.group(2) in services:
            address = self.service_address(match.group(2), int(match.group(3)))
            return f"{match.group(1) or ''}{address}{match.group(4) or ''}"
        return value

    # -- commands ------------------------------------------------------------------------------------

    def secret_value(self, name: str, key: str) -> str:
        """A key of a Secret the chart rendered (base64 in `data`)."""
        return base64.b64decode(one(self.objects, "Secret", name)["data"][key]).decode()

    def environment(self, pod: LocalPod, ctr: dict) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
        env["PYTHONUNBUFFERED"] = "1"
        defined: dict[str, str] = {}  # the container's own env so far: what $(VAR) may name
        for item in ctr.get("env") or []:
            if "value" in item:
                value = expand(item["value"], defined)
                if item["name"].endswith("PORT") and value.isdigit() and int(value) in pod.ports:
                    value = str(pod.ports[int(value)])  # a declared containerPort, made a free port
                defined[item["name"]] = self.localize(pod, value)
            elif "secretKeyRef" in item["valueFrom"]:
                ref = item["valueFrom"]["secretKeyRef"]
                defined[item["name"]] = self.secret_value(ref["name"], ref["key"])
            else:
                field_path = item["valueFrom"]["fieldRef"]["fieldPath"]
                defined[item["name"]] = {"metadata.name": pod.name, "metadata.namespace": NAMESPACE}[
                    field_path
                ]
        return {**env, **defined}

    def command(self, pod: LocalPod, ctr: dict, env: dict[str, str]) -> list[str]:
        args = [expand(a, env) for a in ctr.get("args") or []]
        out: list[str] = []
        for i, arg in enumerate(args):
            previous = args[i - 1] if i else ""
            if previous == "--host" and arg == "0.0.0.0":
                out.append("127.0.0.1")
            elif previous.startswith("--") and previous.endswith("port") and arg.isdigit() and int(arg):
                out.append(str(pod.ports[int(arg)]))  # a declared containerPort, made a free port
            else:
                out.append(self.localize(pod, arg))
        if "--discovery" in out and out[out.index("--discovery") + 1] == "kubernetes":
            out += ["--kubeconfig", str(self.kubeconfig)]  # in-cluster credentials -> the stand-in
        if ctr["command"] == ["redis-server"]:
            out += ["--bind", "127.0.0.1"]  # it listens on every address in the pod
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

    def stop(self) -> dict[str, int | None]:
        """SIGTERM every process (front to back), wait for each, then stop Redis and the API server."""
        codes: dict[str, int | None] = {}
        if self.stopped:
            return codes
        self.stopped = True
        for stage in ("codec", "router", "decode", "prefill", "redis"):  # front to back, as a rollout would
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
        self.api.stop()
        return codes


def expand(value: str, env: dict[str, str]) -> str:
    """$(VAR) as the kubelet expands it in env values and arguments: from `env`, else left as it is."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), value)


def make_api_key(root: Path) -> tuple[str, Path]:
    """A keys file holding one key, made by `kvrelay keys add` as an operator would; the key."""
    path = root / "api-keys" / "keys.yaml"
    result = subprocess.run(
        [*CLI, "keys", "add", "--tenant", "acme", "--file", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return result.stdout.strip(), path


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
    assert REDIS_SERVER is not None, "the bundled Redis runs as redis-server: install it (apt redis-server)"
    objects = chart.render(run_values(model_dir))
    running = Cluster(objects, model_dir, tmp_path_factory.mktemp("pods"))
    try:
        yield running
    finally:
        running.stop()


def test_rendered_containers_run_and_answer_their_probes(cluster: Cluster) -> None:
    started = time.monotonic()
    pods = {stage: cluster.make_pod(stage) for stage in ("redis", "prefill", "decode", "router", "codec")}
    for stage in ("codec", "decode"):  # tokenizer scope, model scope (prefill's is the same command)
        cluster.run_init_containers(pods[stage])
    cluster.publish_endpoint_slices()
    for pod in pods.values():
        cluster.start(pod)
    deadline = started + START_TIMEOUT_S
    wait_probe(pods["redis"], "livenessProbe", deadline)  # its readiness probe is redis-cli's PING
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
    url = f"http://127.0.0.1:{codec_port}/v1/chat/completions"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    headers = {"content-type": "application/json"}
    with pytest.raises(urllib.error.HTTPError) as refused:  # the keys from the Secret are required
        opener.open(urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers), timeout=60)
    assert refused.value.code == 401
    headers["authorization"] = f"Bearer {cluster.api_key}"
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with opener.open(request, timeout=60) as response:  # quotas in the bundled Redis, behind its password
        reply = json.loads(response.read())
    assert reply["usage"]["completion_tokens"] >= 1

    # every declared metrics port serves Prometheus text (the codec's too: off its API port)
    for stage in ("codec", "router", "prefill", "decode"):
        ports = {p["name"]: p["containerPort"] for p in pods[stage].container["ports"]}
        with opener.open(f"http://127.0.0.1:{pods[stage].ports[ports['metrics']]}/metrics", timeout=5) as r:
            assert b"kvrelay_" in r.read()

    # SIGTERM: every process drains and exits by itself. uvicorn re-raises the signal once its graceful
    # shutdown is done, so the codec ends "killed by SIGTERM" (exit 143 in a container) after finishing.
    codes = cluster.stop()
    logs = {s: p.log() for s, p in pods.items()}
    assert codes == {"codec": codes["codec"], "router": 0, "decode": 0, "prefill": 0, "redis": 0}, logs
    assert codes["codec"] in (0, -signal.SIGTERM), logs["codec"]
    assert "Finished server process" in logs["codec"]
