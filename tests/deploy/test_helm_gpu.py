"""GPU workers and the paired stage of the Helm chart: the engine settings a GPU worker gets, the paired pod
(a prefill and a decode container sharing /dev/shm, the pod's IPC and PID namespaces, and one GPU through
a DRA claim), how the router tells its two containers apart, and what the NetworkPolicies let through to
them. Rendered and validated as in test_helm_render.py (helpers in tests/deploy/chart.py); the paired
combos there also go through every generic check (schemas, lint, probes, discovery selectors, config).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from services.cli.main import build_parser
from services.common.config import EngineConfig, load_config
from services.router.discovery import endpoints_from_slices
from tests.deploy import chart
from tests.deploy.chart import (
    NAMESPACE,
    arg_value,
    config_yaml,
    container,
    container_port,
    deployment,
    effective_config_env,
    env_of,
    find,
    fullname,
    one,
    pod_spec,
    render,
)
from tests.deploy.netpol import allowed, rendered_pods

IPC = {"disaggregation": {"transport": "ipc"}}
# Beside the prefill and decode stages, on CPUs: no GPU, no claim.
PAIRED_CPU: dict[str, Any] = {
    "gpu": {"enabled": False},
    "paired": {"enabled": True, "shmSizeLimit": "4Gi"},
    "config": IPC,
}
# Paired pods alone, each sharing one GPU through a DRA claim, the memory split unevenly.
PAIRED_GPU: dict[str, Any] = {
    "prefill": {"enabled": False},
    "decode": {"enabled": False},
    "paired": {
        "enabled": True,
        "gpu": {"dra": True},
        "prefill": {"gpuMemoryUtilization": 0.3},
        "decode": {"gpuMemoryUtilization": 0.6},
    },
    "config": IPC,
}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def paired_cpu() -> list[dict]:
    return render(PAIRED_CPU)


@pytest.fixture(scope="module")
def paired_gpu() -> list[dict]:
    return render(PAIRED_GPU)


def with_values(base: dict[str, Any], **paired: Any) -> dict[str, Any]:
    values = copy.deepcopy(base)
    values["paired"].update(paired)
    return values


def engine_of(objects: list[dict], ctr: dict, tmp_path: Path) -> EngineConfig:
    """The engine config `kvrelay worker` would load in `ctr`: the ConfigMap plus the container's env."""
    path = tmp_path / "config.yaml"
    path.write_text(config_yaml(objects))
    return load_config(path, effective_config_env(ctr)).engine


def paired_containers(objects: list[dict]) -> dict[str, dict]:
    return {c["name"]: c for c in pod_spec(objects, "paired")["containers"]}


def engine_env(ctr: dict) -> set[str]:
    return {name for name in env_of(ctr) if name.startswith("KVRELAY_ENGINE__")}


# -- the engine on GPU workers ----------------------------------------------------------------------------


def test_gpu_workers_run_the_engine_on_cuda_with_a_memory_share(tmp_path: Path) -> None:
    objects = render({})
    for stage in ("prefill", "decode"):
        engine = engine_of(objects, container(objects, stage), tmp_path)
        assert (engine.device, engine.gpu_memory_utilization, engine.cuda_graphs) == ("cuda", 0.9, None)
    for stage in ("codec", "router"):  # no engine there
        assert not engine_env(container(objects, stage))


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_gpu_engine_settings_come_from_the_gpu_values(tmp_path: Path, cuda_graphs: bool) -> None:
    objects = render({"gpu": {"device": "auto", "memoryUtilization": 0.8, "cudaGraphs": cuda_graphs}})
    for stage in ("prefill", "decode"):
        engine = engine_of(objects, container(objects, stage), tmp_path)
        assert (engine.device, engine.gpu_memory_utilization, engine.cuda_graphs) == (
            "auto",
            0.8,
            cuda_graphs,
        )


def test_cpu_workers_keep_the_configured_engine(tmp_path: Path, paired_cpu: list[dict]) -> None:
    """On CPUs the chart sets nothing: engine.kv_cache_memory_mb (values' config) sizes the KV cache."""
    objects = render({"gpu": {"enabled": False}, "config": {"engine": {"device": "cpu"}}})
    for ctr in [
        container(objects, "prefill"),
        container(objects, "decode"),
        *paired_containers(paired_cpu).values(),
    ]:
        assert not engine_env(ctr)
    engine = engine_of(objects, container(objects, "decode"), tmp_path)
    assert (engine.device, engine.kv_cache_memory_mb) == ("cpu", 4096)


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [
        ("device", "cuda:1", "gpu.device"),
        ("gpu_memory_utilization", 0.5, "gpu.memoryUtilization"),
        ("cuda_graphs", False, "gpu.cudaGraphs"),
    ],
)
def test_engine_keys_the_chart_sets_on_gpu_workers_are_refused_in_config(
    key: str, value: Any, instead: str
) -> None:
    """The chart's env would silently win over config.engine.<key>; it says where to set it instead."""
    import helm_python as helm

    with pytest.raises(helm.HelmError, match=rf"config\.engine\.{key}.*set {instead}"):
        render({"config": {"engine": {key: value}}})


def test_paired_containers_split_one_gpu(tmp_path: Path, paired_gpu: list[dict]) -> None:
    shares = {
        role: engine_of(paired_gpu, ctr, tmp_path).gpu_memory_utilization
        for role, ctr in paired_containers(paired_gpu).items()
    }
    assert shares == {"prefill": 0.3, "decode": 0.6}
    import helm_python as helm

    with pytest.raises(helm.HelmError, match=r"at most 0\.95"):
        render(with_values(PAIRED_GPU, prefill={"gpuMemoryUtilization": 0.5}))
    render(with_values(PAIRED_GPU, prefill={"gpuMemoryUtilization": 0.35}))  # 0.35 + 0.6 = 0.95: allowed


# -- the paired pod ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["paired_cpu", "paired_gpu"])
def test_paired_pod_runs_a_prefill_and_a_decode_worker_sharing_dev_shm(
    request: pytest.FixtureRequest, shape: str
) -> None:
    objects = request.getfixturevalue(shape)
    spec = pod_spec(objects, "paired")
    parser = build_parser()
    ports: set[int] = set()
    for ctr in spec["containers"]:
        args = parser.parse_args(ctr["args"])
        assert (args.command, args.role) == ("worker", ctr["name"])
        ports |= {args.port, args.metrics_port}
        (shm,) = [m for m in ctr["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        assert shm["name"] == "dshm" and not shm.get("readOnly")
        sleep = int(ctr["lifecycle"]["preStop"]["exec"]["command"][1])
        assert spec["terminationGracePeriodSeconds"] > sleep + float(args.grace_seconds)
    assert [c["name"] for c in spec["containers"]] == ["prefill", "decode"]
    assert len(ports) == 4  # one network namespace: every port its own
    (volume,) = [v for v in spec["volumes"] if v["name"] == "dshm"]
    size = PAIRED_CPU["paired"]["shmSizeLimit"] if shape == "paired_cpu" else "8Gi"
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": size}
    # the pod's own IPC namespace (shared by its containers) and PID namespace; nothing of the host's
    assert spec["shareProcessNamespace"] is True
    assert not {"hostIPC", "hostPID", "hostNetwork"} & spec.keys()


def test_paired_pod_shares_one_gpu_through_a_dra_claim(
    paired_gpu: list[dict], paired_cpu: list[dict]
) -> None:
    template = one(paired_gpu, "ResourceClaimTemplate", fullname("paired-gpu"))
    assert template["apiVersion"] == "resource.k8s.io/v1beta1"
    assert template["spec"]["spec"]["devices"]["requests"] == [
        {"name": "gpu", "deviceClassName": "gpu.nvidia.com"}
    ]
    spec = pod_spec(paired_gpu, "paired")
    assert spec["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": fullname("paired-gpu")}]
    for ctr in spec["containers"]:
        assert ctr["resources"]["claims"] == [{"name": "gpu"}]  # both: one device for the two
        assert "nvidia.com/gpu" not in json.dumps(ctr["resources"])
        assert ctr["image"].endswith("-cuda")
    assert GPU_TOLERATION in spec["tolerations"]
    # on CPUs: no claim, no GPU
    assert not find(paired_cpu, "ResourceClaimTemplate")
    assert "resourceClaims" not in pod_spec(paired_cpu, "paired")
    assert "nvidia.com/gpu" not in json.dumps(deployment(paired_cpu, "paired"))


@pytest.mark.parametrize(
    ("api_version", "kube_version", "nested"),
    [
        ("resource.k8s.io/v1beta1", "1.32.0", False),
        ("resource.k8s.io/v1beta2", "1.33.0", True),
        ("resource.k8s.io/v1", "1.34.0", True),
    ],
)
def test_the_gpu_claim_renders_for_each_dra_api_version(
    api_version: str, kube_version: str, nested: bool
) -> None:
    values = with_values(
        PAIRED_GPU, gpu={"dra": True, "apiVersion": api_version, "deviceClassName": "gpu.example.com"}
    )
    objects = render(values)
    template = one(objects, "ResourceClaimTemplate", fullname("paired-gpu"))
    assert template["apiVersion"] == api_version
    (gpu_request,) = template["spec"]["spec"]["devices"]["requests"]
    assert (gpu_request["exactly"] if nested else gpu_request)["deviceClassName"] == "gpu.example.com"
    for obj in (template, deployment(objects, "paired")):
        assert not chart.validation_errors(obj, kube_version)


def test_paired_gpu_without_dra_is_refused() -> None:
    """The device plugin would give each container its own GPU: no IPC between them, so no pod at all."""
    import helm_python as helm

    with pytest.raises(helm.HelmError, match=r"paired\.gpu\.dra: true.*torch or grpc"):
        render({"paired": {"enabled": True}})


def test_paired_ports_must_differ() -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmError, match="ports must differ"):
        render(with_values(PAIRED_CPU, decode={"port": 50051}))


# -- the router finds both containers ----------------------------------------------------------------------


def test_router_names_the_two_containers_of_a_paired_pod_apart(paired_cpu: list[dict]) -> None:
    """The EndpointSlices the controller makes for the two paired Services list one pod twice, at two ports;
    the router's discovery makes two replicas of it, with their own names and addresses."""
    router_args = container(paired_cpu, "router")["args"]
    port_name = arg_value(router_args, "--port-name")
    containers = paired_containers(paired_cpu)
    slices, expected = [], set()
    for role in ("prefill", "decode"):
        svc = one(paired_cpu, "Service", fullname(f"paired-{role}"))
        assert f"kubernetes.io/service-name={svc['metadata']['name']}" in router_args
        port = next(p for p in svc["spec"]["ports"] if p["name"] == port_name)
        number = container_port(containers[role], port["targetPort"])
        slices.append(
            {
                "metadata": {"name": f"{svc['metadata']['name']}-abcde"},
                "ports": [{"name": port["name"], "port": number, "protocol": "TCP"}],
                "endpoints": [
                    {"addresses": ["10.1.2.3"], "targetRef": {"kind": "Pod", "name": "kv-paired-0"}}
                ],
            }
        )
        expected.add(f"10.1.2.3:{number}")
    endpoints = endpoints_from_slices(slices, port_name)
    assert {e.address for e in endpoints} == expected
    assert len({e.name for e in endpoints}) == 2


def test_service_monitor_scrapes_both_paired_containers() -> None:
    objects = render({**PAIRED_CPU, "metrics": {"serviceMonitor": {"enabled": True}}})
    (sm,) = find(objects, "ServiceMonitor")
    selector = sm["spec"]["selector"]["matchLabels"]
    for role in ("prefill", "decode"):
        svc = one(objects, "Service", fullname(f"paired-{role}"))
        assert selector.items() <= svc["metadata"]["labels"].items()
        metrics = next(p for p in svc["spec"]["ports"] if p["name"] == "metrics")
        assert container_port(paired_containers(objects)[role], metrics["targetPort"]) == metrics["port"]


# -- NetworkPolicies -----------------------------------------------------------------------------------------


def test_network_policies_let_the_router_and_kv_pullers_reach_paired_pods(paired_cpu: list[dict]) -> None:
    policies = find(paired_cpu, "NetworkPolicy")
    pods = rendered_pods(paired_cpu, NAMESPACE)

    def may(src: str, dst: str, port: str | int) -> bool:
        return allowed(policies, pods[src], pods[dst], port)

    # the router reaches both containers
    assert may("router", "paired", "prefill-grpc") and may("router", "paired", "decode-grpc")
    # the prefill container serves KV to every decode worker: its own pod's, other paired pods', decode pods'
    assert may("paired", "paired", "prefill-grpc") and may("decode", "paired", "prefill-grpc")
    # and paired decode containers pull from the prefill stage
    assert may("paired", "prefill", "grpc")
    for src in ("codec", "stranger", "other-namespace", "prometheus"):
        assert not may(src, "paired", "prefill-grpc"), src
    # the decode container: the router only
    for src in ("codec", "prefill", "decode", "paired", "stranger", "other-namespace"):
        assert not may(src, "paired", "decode-grpc"), src
    # metrics ports: the scrapers only
    for port in ("prefill-metrics", "decode-metrics"):
        assert may("prometheus", "paired", port) and not may("stranger", "paired", port)
    # no torch transport: no other port between worker pods
    assert not may("prefill", "paired", 29500) and not may("paired", "decode", 29500)


def test_torch_transport_opens_every_port_between_all_worker_pods() -> None:
    objects = render({**PAIRED_CPU, "config": {"disaggregation": {"transport": "torch"}}})
    policies = find(objects, "NetworkPolicy")
    pods = rendered_pods(objects, NAMESPACE)
    for src, dst in (("prefill", "paired"), ("paired", "decode"), ("decode", "paired"), ("paired", "paired")):
        assert allowed(policies, pods[src], pods[dst], 29500), (src, dst)
    assert not allowed(policies, pods["codec"], pods["paired"], 29500)
