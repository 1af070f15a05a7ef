"""The Helm chart (deploy/helm/kvrelay), rendered by Helm itself for the default values (with API keys,
which the chart requires) and for several combinations, every object validated against the Kubernetes
schemas, and the properties that matter checked: probes, RBAC, NetworkPolicies, resources, Secrets,
draining, the model volume, scaling. test_helm_security.py covers auth, Redis and internal TLS,
test_helm_egress.py the egress rules, test_helm_metrics_logs_quotas.py those settings.

Rendering uses the helm-python-sdk package (Helm v4 as a library): no helm binary, no cluster, no
network. tests/deploy/chart.py holds the rendering and validation helpers.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from services.cli.main import build_parser
from services.common.config import load_config
from tests.deploy import chart
from tests.deploy.chart import (
    ALERTS,
    CRD_KINDS,
    DASHBOARD,
    KUBE_VERSION,
    MIN_KUBE_VERSION,
    NAMESPACE,
    arg_value,
    arg_values,
    container,
    container_port,
    containers_of,
    deployment,
    effective_config_env,
    env_of,
    find,
    fullname,
    one,
    paired_container,
    pod_spec,
    render,
)
from tests.deploy.netpol import Pod, allowed, rendered_pods

FINGERPRINT = "94462147180b56709595a2d5ad82bc568aa75d1a3d2659105f5319e7b2727109"
DRA_MIN_KUBE_VERSION = "1.32.0"  # the first with resource.k8s.io/v1beta1 (the paired pods' GPU claim)

COMBOS: dict[str, dict[str, Any]] = {
    "default": {},
    "cpu-only": {"gpu": {"enabled": False}, "prefill": {"threads": 8}, "decode": {"threads": 8}},
    "gpu": {
        "gpu": {"enabled": True, "perWorker": 2},
        "decode": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}},
        "config": {"disaggregation": {"transport": "torch"}},
    },
    "external-redis-secret": {
        "redis": {"enabled": False, "external": {"existingSecret": "kvrelay-redis", "key": "url"}}
    },
    "external-redis-url": {"redis": {"enabled": False, "external": {"url": "redis://redis.shared:6379/3"}}},
    "decode-x6": {"decode": {"replicas": 6}},
    "autoscaled-workers": {
        "decode": {"autoscaling": {"enabled": True, "minReplicas": 2, "maxReplicas": 12}},
        "prefill": {"autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3}},
    },
    "colocated-no-redis": {
        "prefill": {"enabled": False},
        "decode": {"role": "colocated", "replicas": 3},
        "redis": {"enabled": False},
        "codec": {"autoscaling": {"enabled": False}, "replicas": 1, "grpcPort": 0},
    },
    "everything": {
        "image": {
            "registry": "registry.example.com/ml",
            "tag": "1.4.2",
            "pullSecrets": [{"name": "regcred"}],
        },
        "model": {"version": "smollm2-v7", "fingerprint": FINGERPRINT, "servedName": "smollm2"},
        "internalToken": {"existingSecret": "kvrelay-token", "key": "internal"},
        "auth": {"existingSecret": "kvrelay-api-keys", "key": "keys.yaml"},
        "config": {"disaggregation": {"transport": "torch"}, "limits": {"max_output_tokens": 512}},
        "ingress": {
            "enabled": True,
            "tls": [{"secretName": "kvrelay-tls", "hosts": ["kvrelay.example.com"]}],
            "canary": {"enabled": True, "weight": 20},
        },
        "router": {"autoscaling": {"enabled": True}},
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
        },
        "networkPolicy": {"codecFrom": [{"namespaceSelector": {"matchLabels": {"name": "ingress-nginx"}}}]},
    },
    # the paired stage beside the prefill and decode stages, on CPUs (no GPU, no DRA claim)
    "paired-cpu": {
        "gpu": {"enabled": False},
        "paired": {"enabled": True, "replicas": 2},
        "config": {"disaggregation": {"transport": "ipc"}},
    },
    # paired pods only, each sharing one GPU through a DRA claim
    "paired-gpu": {
        "prefill": {"enabled": False},
        "decode": {"enabled": False},
        "paired": {"enabled": True, "gpu": {"dra": True}},
        "config": {"disaggregation": {"transport": "ipc"}},
    },
    # everything secure at once: keys, Redis password and TLS, internal mTLS through cert-manager, tracing
    "secure": {
        "internalTls": {
            "enabled": True,
            "certManager": {"enabled": True, "issuerRef": {"name": "kvrelay-ca"}},
        },
        "redis": {"tls": {"enabled": True}},
        "paired": {"enabled": True},
        "gpu": {"enabled": False},
        "config": {"tracing": {"otlp_endpoint": "http://otel-collector.monitoring:4317"}},
        "logLevel": "warning",
        "decode": {"logLevel": "debug"},
    },
    "open-mode": {"auth": {"allowOpen": True}},
    "fetched-model": {
        "model": {
            "fetch": {
                "enabled": True,
                "command": ["sh", "-c", "cp -r /seed/$KVRELAY_MODEL_VERSION $KVRELAY_MODEL_DIR"],
                "sizeLimit": "10Gi",
            },
            "fingerprint": FINGERPRINT,
        }
    },
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in COMBOS.items()}


@pytest.fixture(scope="module")
def default(rendered: dict[str, list[dict]]) -> list[dict]:
    return rendered["default"]


def kvrelay_deployments(objects: list[dict]) -> list[dict]:
    return [
        d
        for d in find(objects, "Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] != "redis"
    ]


def stages_of(combo: str) -> tuple[str, ...]:
    """The combo's one-container stages: codec, router and the enabled prefill and decode stages."""
    return tuple(s for s in chart.STAGES if COMBOS[combo].get(s, {}).get("enabled", True))


def is_paired(combo: str) -> bool:
    return bool(COMBOS[combo].get("paired", {}).get("enabled", False))


def server_containers(objects: list[dict], combo: str) -> list[tuple[str, dict]]:
    """(stage, container) for every kvrelay server container: one per stage, two in a paired pod."""
    out = [(stage, container(objects, stage)) for stage in stages_of(combo)]
    if is_paired(combo):
        out += [("paired", ctr) for ctr in pod_spec(objects, "paired")["containers"]]
    return out


def deployment_stages(combo: str) -> tuple[str, ...]:
    return stages_of(combo) + (("paired",) if is_paired(combo) else ())


def uses_dra(combo: str) -> bool:
    values = COMBOS[combo]
    return is_paired(combo) and values.get("gpu", {}).get("enabled", True) and values["paired"]["gpu"]["dra"]


# -- every object is valid Kubernetes ------------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS)
@pytest.mark.parametrize("version", [KUBE_VERSION, MIN_KUBE_VERSION])
def test_every_rendered_object_validates(rendered: dict[str, list[dict]], combo: str, version: str) -> None:
    if version == MIN_KUBE_VERSION and uses_dra(combo):
        version = DRA_MIN_KUBE_VERSION  # resource.k8s.io/v1beta1 and pods' resourceClaims as they are now
    objects = rendered[combo]
    assert objects
    problems = []
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue  # no Kubernetes schema; checked in test_service_monitor
        problems += [
            f"{obj['kind']}/{obj['metadata']['name']}: {e}" for e in chart.validation_errors(obj, version)
        ]
    assert not problems, "\n".join(problems)


def test_validation_rejects_a_broken_object(default: list[dict]) -> None:
    """The validator is strict: a misspelled field, a wrong type or a missing required field fails."""
    broken = copy.deepcopy(deployment(default, "decode"))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    broken["spec"]["replicas"] = "two"
    del broken["spec"]["selector"]
    errors = "\n".join(chart.validation_errors(broken))
    assert "readinessProbes" in errors and "'two'" in errors and "selector" in errors


@pytest.mark.parametrize("combo", COMBOS)
def test_object_names_are_unique_per_kind(rendered: dict[str, list[dict]], combo: str) -> None:
    keys = [(o["kind"], o["metadata"]["name"]) for o in rendered[combo]]
    assert len(keys) == len(set(keys))


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"decode": {"replica": 3}}, "replica"),
        ({"model": {"fingerprint": "not-hex"}}, "fingerprint"),
        ({"decode": {"role": "prefill"}}, "role"),
        ({"prefill": {"threads": 0}}, "threads"),
        ({"redis": {"external": {"url": "http://redis:6379"}}}, "url"),
        ({"config": {"disaggregation": {"transport": "rdma"}}}, "transport"),
        ({"gpu": {"memoryUtilization": 1.5}}, "memoryUtilization"),
        ({"gpu": {"device": "cpu"}}, "device"),
        ({"paired": {"prefill": {"gpuMemoryUtilization": 0}}}, "gpuMemoryUtilization"),
        ({"paired": {"gpu": {"apiVersion": "resource.k8s.io/v1alpha3"}}}, "apiVersion"),
        ({"paired": {"replica": 2}}, "replica"),
        ({"auth": {"allowOpen": "yes"}}, "allowOpen"),
        ({"codec": {"metricsPort": 70000}}, "metricsPort"),
        ({"networkPolicy": {"egress": {"kubernetesApi": {"cidrs": ["10.0.0.1"]}}}}, "cidrs"),
        ({"networkPolicy": {"extraEgress": {"prefill": []}}}, "prefill"),
        ({"internalTls": {"certManager": {"issuer": "ca"}}}, "issuer"),
        ({"redis": {"responsesKeyPrefix": ""}}, "responsesKeyPrefix"),
    ],
)
def test_values_schema_refuses_mistakes(values: dict, complaint: str) -> None:
    """values.schema.json: a typo or a bad value fails at install, naming the key."""
    import helm_python as helm

    with helm.Chart.load(chart.CHART_DIR) as loaded, pytest.raises(helm.HelmError, match=complaint):
        loaded.validate_schema(loaded.merge_values(values))


@pytest.mark.parametrize("transport", ["grpc", "torch", "ipc"])
def test_values_schema_accepts_every_transport(transport: str) -> None:
    import helm_python as helm

    with helm.Chart.load(chart.CHART_DIR) as loaded:
        loaded.validate_schema(loaded.merge_values({"config": {"disaggregation": {"transport": transport}}}))


def test_chart_links_to_the_dashboard_and_alert_directories() -> None:
    """dashboards/ and alerts/ are links into deploy/grafana and deploy/prometheus: one copy of each file."""
    for link, target in (("dashboards", "grafana"), ("alerts", "prometheus")):
        path = chart.CHART_DIR / link
        assert path.is_symlink() and path.resolve() == chart.REPO_ROOT / "deploy" / target


def test_helm_lint_finds_nothing_to_warn_about() -> None:
    import helm_python as helm

    for values in COMBOS.values():
        report = helm.lint(
            chart.CHART_DIR, chart.with_base(values), strict=True, kube_version=f"v{KUBE_VERSION}"
        )
        assert not report["errors"], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


# -- one Deployment per stage, each scaled on its own --------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS)
def test_one_deployment_per_stage(rendered: dict[str, list[dict]], combo: str) -> None:
    objects = rendered[combo]
    names = sorted(d["metadata"]["name"] for d in kvrelay_deployments(objects))
    assert names == sorted(fullname(s) for s in deployment_stages(combo))
    for stage in deployment_stages(combo):
        d = deployment(objects, stage)
        labels = d["spec"]["template"]["metadata"]["labels"]
        assert labels["app.kubernetes.io/component"] == stage
        assert d["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_decode_replicas_are_their_own(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["decode-x6"]
    assert deployment(objects, "decode")["spec"]["replicas"] == 6
    assert deployment(objects, "prefill")["spec"]["replicas"] == 1
    assert deployment(objects, "router")["spec"]["replicas"] == 2
    # the codec has an HPA by default, so its Deployment leaves replicas to it
    assert "replicas" not in deployment(objects, "codec")["spec"]
    hpa = one(objects, "HorizontalPodAutoscaler", fullname("codec"))
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": fullname("codec"),
    }
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 8)


def test_worker_autoscaling_on_queue_depth(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["autoscaled-workers"]
    for stage, floor, ceiling in (("decode", 2, 12), ("prefill", 1, 3)):
        assert "replicas" not in deployment(objects, stage)["spec"]
        hpa = one(objects, "HorizontalPodAutoscaler", fullname(stage))
        assert hpa["spec"]["scaleTargetRef"]["name"] == fullname(stage)
        assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (floor, ceiling)
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods"
        # the gauge the worker exports on its metrics port (services/worker/metrics.py)
        assert metric["pods"]["metric"]["name"] == "kvrelay_worker_waiting_requests"
        assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "4"}
    assert not find(rendered["default"], "HorizontalPodAutoscaler", fullname("decode"))


@pytest.mark.parametrize("combo", COMBOS)
def test_every_stage_has_a_disruption_budget(rendered: dict[str, list[dict]], combo: str) -> None:
    objects = rendered[combo]
    for stage in deployment_stages(combo):
        pdb = one(objects, "PodDisruptionBudget", fullname(stage))
        assert (
            pdb["spec"]["selector"]["matchLabels"]
            == deployment(objects, stage)["spec"]["selector"]["matchLabels"]
        )
        assert ("minAvailable" in pdb["spec"]) != ("maxUnavailable" in pdb["spec"])


# -- probes match the services' health endpoints -------------------------------------------------------


def test_codec_probes_are_its_http_health_routes(default: list[dict]) -> None:
    ctr = container(default, "codec")
    probes = {kind: ctr[kind]["httpGet"] for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["startupProbe"]["path"] == "/health"
    assert probes["livenessProbe"]["path"] == "/health"
    assert probes["readinessProbe"]["path"] == "/ready"
    http_port = int(arg_value(ctr["args"], "--port"))
    for probe in probes.values():
        assert container_port(ctr, probe["port"]) == http_port


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_worker_probes_are_grpc_health_services(default: list[dict], stage: str) -> None:
    ctr = container(default, stage)
    grpc_port = int(arg_value(ctr["args"], "--port"))
    assert ctr["startupProbe"]["grpc"] == {"port": grpc_port, "service": ""}
    assert ctr["readinessProbe"]["grpc"] == {"port": grpc_port, "service": ""}
    assert ctr["livenessProbe"]["grpc"] == {"port": grpc_port, "service": "kvrelay.liveness"}
    # loading and warming up a model may take minutes: the startup probe allows for it
    startup = ctr["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_router_probes(default: list[dict]) -> None:
    ctr = container(default, "router")
    grpc_port = int(arg_value(ctr["args"], "--port"))
    # ready: health "" SERVING (a decode replica is usable); alive: the port accepts connections
    assert ctr["readinessProbe"]["grpc"] == {"port": grpc_port, "service": ""}
    assert container_port(ctr, ctr["livenessProbe"]["tcpSocket"]["port"]) == grpc_port
    assert container_port(ctr, ctr["startupProbe"]["tcpSocket"]["port"]) == grpc_port


@pytest.mark.parametrize("combo", COMBOS)
def test_every_server_container_has_three_probes(rendered: dict[str, list[dict]], combo: str) -> None:
    for d in find(rendered[combo], "Deployment"):
        for ctr in d["spec"]["template"]["spec"]["containers"]:
            if d["metadata"]["labels"]["app.kubernetes.io/component"] == "redis":
                assert {"readinessProbe", "livenessProbe"} <= ctr.keys()
                continue
            assert {"startupProbe", "readinessProbe", "livenessProbe"} <= ctr.keys(), d["metadata"]["name"]


# -- draining ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", chart.STAGES)
def test_prestop_and_termination_grace_cover_the_drain(default: list[dict], stage: str) -> None:
    spec = pod_spec(default, stage)
    ctr = container(default, stage)
    sleep = ctr["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep" and int(sleep[1]) > 0
    grace = float(arg_value(ctr["args"], "--grace-seconds"))
    assert spec["terminationGracePeriodSeconds"] > int(sleep[1]) + grace


# -- RBAC and discovery --------------------------------------------------------------------------------


def test_router_rbac_lets_it_list_and_watch_endpointslices_only(default: list[dict]) -> None:
    role = one(default, "Role", fullname("router"))
    assert role["rules"] == [
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        }
    ]
    assert not find(default, "ClusterRole") and not find(default, "ClusterRoleBinding")
    binding = one(default, "RoleBinding", fullname("router"))
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": fullname("router"),
    }
    account = one(default, "ServiceAccount", fullname("router"))
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": fullname("router"), "namespace": NAMESPACE}
    ]
    router = pod_spec(default, "router")
    assert router["serviceAccountName"] == account["metadata"]["name"]
    assert router["automountServiceAccountToken"] is True
    for stage in ("codec", "prefill", "decode"):  # nobody else gets API credentials
        assert pod_spec(default, stage)["automountServiceAccountToken"] is False


@pytest.mark.parametrize("combo", COMBOS)
def test_router_discovers_the_headless_worker_services(rendered: dict[str, list[dict]], combo: str) -> None:
    objects = rendered[combo]
    args = container(objects, "router")["args"]
    assert arg_value(args, "--discovery") == "kubernetes"
    assert arg_value(args, "--namespace") == NAMESPACE
    # (Service, Deployment, container) behind each worker pool: one per stage, one per paired container
    pools: list[tuple[str, str, dict]] = [
        (s, s, container(objects, s)) for s in ("prefill", "decode") if s in stages_of(combo)
    ]
    if is_paired(combo):
        pools += [(f"paired-{r}", "paired", paired_container(objects, r)) for r in ("prefill", "decode")]
    # the EndpointSlice controller labels each slice with its Service's name
    selectors = [f"kubernetes.io/service-name={fullname(service)}" for service, _, _ in pools]
    assert arg_values(args, "--selector") == selectors
    for service, stage, worker in pools:
        svc = one(objects, "Service", fullname(service))
        assert svc["spec"]["clusterIP"] == "None"
        assert svc["spec"]["selector"] == deployment(objects, stage)["spec"]["selector"]["matchLabels"]
        port = next(p for p in svc["spec"]["ports"] if p["name"] == arg_value(args, "--port-name"))
        assert container_port(worker, port["targetPort"]) == int(arg_value(worker["args"], "--port"))


def test_codec_dials_the_router_service(default: list[dict]) -> None:
    address = arg_value(container(default, "codec")["args"], "--router")
    svc = one(default, "Service", fullname("router"))
    grpc = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert address == f"{svc['metadata']['name']}:{grpc['port']}"
    assert container_port(container(default, "router"), grpc["targetPort"]) == int(
        arg_value(container(default, "router")["args"], "--port")
    )


def test_model_fingerprint_pins_the_router_pool(rendered: dict[str, list[dict]]) -> None:
    assert (
        arg_value(container(rendered["everything"], "router")["args"], "--model-fingerprint") == FINGERPRINT
    )
    assert "--model-fingerprint" not in container(rendered["default"], "router")["args"]


# -- NetworkPolicies -----------------------------------------------------------------------------------


def pods(objects: list[dict]) -> dict[str, Pod]:
    return rendered_pods(objects, NAMESPACE)


@pytest.mark.parametrize("combo", ["default", "gpu"])
def test_network_policy_matrix(rendered: dict[str, list[dict]], combo: str) -> None:
    objects = rendered[combo]
    policies = find(objects, "NetworkPolicy")
    p = pods(objects)
    torch_transport = combo == "gpu"

    def may(src: str, dst: str, port: int | str) -> bool:
        return allowed(policies, p[src], p[dst], port)

    # the codec is public (no codecFrom): anyone may reach its HTTP and gRPC ports
    for src in ("stranger", "other-namespace", "prometheus"):
        assert may(src, "codec", "http") and may(src, "codec", "grpc")
    # router: gRPC from the codec only
    assert may("codec", "router", "grpc")
    for src in ("stranger", "other-namespace", "prometheus", "decode", "prefill"):
        assert not may(src, "router", "grpc"), src
    # decode workers: gRPC from the router only (and, with the torch transport, anything from prefill)
    assert may("router", "decode", "grpc")
    for src in ("codec", "stranger", "other-namespace", "prometheus"):
        assert not may(src, "decode", "grpc"), src
    assert may("prefill", "decode", "grpc") is torch_transport
    # prefill workers: from the router, and from decode workers (they pull KV over gRPC)
    assert may("router", "prefill", "grpc") and may("decode", "prefill", "grpc")
    for src in ("codec", "stranger", "other-namespace", "prometheus"):
        assert not may(src, "prefill", "grpc"), src
    # metrics ports: from the monitoring namespace only
    for dst in ("router", "prefill", "decode"):
        assert may("prometheus", dst, "metrics")
        assert not may("stranger", dst, "metrics") and not may("other-namespace", dst, "metrics")
    # bundled Redis: the codec only
    assert may("codec", "redis", "redis")
    for src in ("router", "decode", "stranger", "other-namespace"):
        assert not may(src, "redis", "redis"), src
    # torch transport: prefill and decode reach each other on any port (TCPStore, gloo/NCCL)
    assert may("prefill", "decode", 29500) is torch_transport
    assert may("decode", "prefill", 41234) is torch_transport
    assert not may("codec", "decode", 29500)


def test_codec_sources_can_be_restricted(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["everything"]
    policies = find(objects, "NetworkPolicy")
    p = pods(objects)
    ingress_controller = Pod("ingress-nginx", {"app": "nginx"}, {"name": "ingress-nginx"})
    assert allowed(policies, ingress_controller, p["codec"], "http")
    assert not allowed(policies, p["other-namespace"], p["codec"], "http")


# -- resources -----------------------------------------------------------------------------------------


def test_workers_get_a_gpu_by_default(default: list[dict]) -> None:
    for stage in ("prefill", "decode"):
        spec, ctr = pod_spec(default, stage), container(default, stage)
        assert ctr["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert ctr["image"].endswith("-cuda")
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert {e["name"] for e in ctr["env"]} >= {"NCCL_DEBUG", "NCCL_SOCKET_IFNAME"}
        assert int(arg_value(ctr["args"], "--threads")) >= 1
    for stage in ("codec", "router"):
        ctr = container(default, stage)
        assert "nvidia.com/gpu" not in str(ctr["resources"])
        assert "tolerations" not in pod_spec(default, stage)


def test_cpu_only_workers(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["cpu-only"]
    for stage in ("prefill", "decode"):
        ctr = container(objects, stage)
        assert "nvidia.com/gpu" not in json.dumps(deployment(objects, stage))
        assert ctr["image"].endswith(":0.1.0-cpu")
        assert "NCCL_DEBUG" not in {e["name"] for e in ctr["env"]}
        assert arg_value(ctr["args"], "--threads") == "8"


def test_gpu_count_and_node_selector(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["gpu"]
    assert container(objects, "decode")["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod_spec(objects, "decode")["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert "nodeSelector" not in pod_spec(objects, "prefill")


@pytest.mark.parametrize("combo", COMBOS)
def test_every_container_declares_requests_and_a_memory_limit(
    rendered: dict[str, list[dict]], combo: str
) -> None:
    for d in find(rendered[combo], "Deployment"):
        for ctr in containers_of(d):
            resources = ctr.get("resources") or {}
            if ctr["name"] == "fetch-model":
                continue  # the user's fetch step sizes itself (model.fetch.resources)
            assert {"cpu", "memory"} <= resources.get("requests", {}).keys(), (
                d["metadata"]["name"],
                ctr["name"],
            )
            assert "memory" in resources.get("limits", {}), (d["metadata"]["name"], ctr["name"])


# -- Secrets and config ---------------------------------------------------------------------------------


def mount_source(objects: list[dict], stage: str, path: str, ctr: dict | None = None) -> dict:
    """The pod volume mounted at the directory holding `path` in `ctr` (default: the stage's container)."""
    ctr = ctr or container(objects, stage)
    mount = next(m for m in ctr["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/"))
    return next(v for v in pod_spec(objects, stage)["volumes"] if v["name"] == mount["name"])


@pytest.mark.parametrize("combo", ["default", "everything"])
def test_internal_token_comes_from_a_secret_file(rendered: dict[str, list[dict]], combo: str) -> None:
    objects = rendered[combo]
    expected = "kvrelay-token" if combo == "everything" else fullname("internal-token")
    key = "internal" if combo == "everything" else "token"
    for stage in chart.STAGES:
        env = env_of(container(objects, stage))
        path = env["KVRELAY_INTERNAL_TOKEN_FILE"]["value"]
        assert "KVRELAY_INTERNAL_TOKEN" not in env  # never a literal in the pod spec
        volume = mount_source(objects, stage, path)
        assert volume["secret"]["secretName"] == expected
        assert path.endswith("/" + key)
        mount = next(m for m in container(objects, stage)["volumeMounts"] if m["name"] == volume["name"])
        assert mount["readOnly"] is True and "subPath" not in mount  # subPath would freeze rotations
    secrets = find(objects, "Secret", expected)
    if combo == "everything":
        assert not secrets  # referenced, never created
    else:
        (secret,) = secrets
        assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
        assert len(secret["data"]["token"]) >= 48


@pytest.mark.parametrize("combo", ["default", "everything"])
def test_api_keys_come_from_a_secret(rendered: dict[str, list[dict]], combo: str) -> None:
    objects = rendered[combo]
    config = yaml.safe_load(chart.config_yaml(objects))
    keys_file = config["auth"]["keys_file"]
    volume = mount_source(objects, "codec", keys_file)
    assert volume["secret"]["secretName"] == chart.KEYS_SECRET
    assert keys_file.endswith("/keys.yaml")
    assert "allow_open" not in config["auth"]


def test_external_redis_url_comes_from_a_secret(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["external-redis-secret"]
    env = env_of(container(objects, "codec"))
    for name in ("KVRELAY_QUOTAS__REDIS_URL", "KVRELAY_RESPONSES__REDIS_URL"):
        assert env[name]["valueFrom"] == {"secretKeyRef": {"name": "kvrelay-redis", "key": "url"}}
        assert "value" not in env[name]
    assert not [d for d in find(objects, "Deployment") if "redis" in d["metadata"]["name"]]
    assert yaml.safe_load(chart.config_yaml(objects))["quotas"]["backend"] == "redis"


def test_bundled_and_plain_external_redis(rendered: dict[str, list[dict]]) -> None:
    bundled = env_of(container(rendered["default"], "codec"))
    svc = one(rendered["default"], "Service", fullname("redis"))
    url = f"redis://:$(REDIS_PASSWORD)@{svc['metadata']['name']}:6379"
    assert bundled["KVRELAY_QUOTAS__REDIS_URL"]["value"] == f"{url}/0"
    assert bundled["KVRELAY_RESPONSES__REDIS_URL"]["value"] == f"{url}/1"  # a database of its own
    plain = env_of(container(rendered["external-redis-url"], "codec"))
    assert plain["KVRELAY_RESPONSES__REDIS_URL"]["value"] == "redis://redis.shared:6379/3"
    assert "REDIS_PASSWORD" not in plain
    none = env_of(container(rendered["colocated-no-redis"], "codec"))
    assert "KVRELAY_QUOTAS__REDIS_URL" not in none
    assert "quotas" not in yaml.safe_load(chart.config_yaml(rendered["colocated-no-redis"]))


@pytest.mark.parametrize("combo", COMBOS)
def test_config_map_is_a_valid_kvrelay_config(rendered: dict[str, list[dict]], combo: str, tmp_path) -> None:
    objects = rendered[combo]
    path = tmp_path / "config.yaml"
    path.write_text(chart.config_yaml(objects))
    for stage, ctr in server_containers(objects, combo):
        assert arg_value(ctr["args"], "--config") == "/etc/kvrelay/config/config.yaml"
        config_map = mount_source(objects, stage, "/etc/kvrelay/config/config.yaml", ctr)["configMap"]
        assert config_map["name"] == fullname("config")
        cfg = load_config(path, effective_config_env(ctr))  # ConfigError on anything kvrelay would refuse
        assert (
            cfg.model.path
            == f"/models/{COMBOS[combo].get('model', {}).get('version', 'smollm2-135m-instruct')}"
        )
        assert cfg.server.host == "0.0.0.0"
    if combo == "everything":
        assert cfg.limits.max_output_tokens == 512 and cfg.disaggregation.transport == "torch"


def test_config_change_rolls_the_pods() -> None:
    a = render({})
    b = render({"config": {"engine": {"kv_cache_memory_mb": 8192}}})
    for stage in chart.STAGES:
        before = deployment(a, stage)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        after = deployment(b, stage)["spec"]["template"]["metadata"]["annotations"]["checksum/config"]
        assert before != after


# -- commands parse with the real CLI ------------------------------------------------------------------


@pytest.mark.parametrize("combo", COMBOS)
def test_rendered_commands_parse_with_the_kvrelay_cli(rendered: dict[str, list[dict]], combo: str) -> None:
    parser = build_parser()
    for stage, ctr in server_containers(rendered[combo], combo):
        assert ctr["command"] == ["kvrelay"]
        args = parser.parse_args(ctr["args"])
        assert args.command == ("worker" if stage in ("prefill", "decode", "paired") else stage)
        if stage in ("prefill", "decode"):
            expected_role = "colocated" if combo == "colocated-no-redis" else stage
            assert args.role == expected_role
            assert args.host == "0.0.0.0"
            assert args.name == "$(POD_NAME)"  # expanded by the kubelet from the env
            assert "POD_NAME" in env_of(ctr)
        if stage == "paired":  # one worker per container, named apart
            assert args.role == ctr["name"] and args.name == f"$(POD_NAME)-{ctr['name']}"


# -- the model: a read-only volume, a version apart from the image tag ---------------------------------


@pytest.mark.parametrize("combo", COMBOS)
def test_model_volume_is_mounted_read_only(rendered: dict[str, list[dict]], combo: str) -> None:
    objects = rendered[combo]
    for stage in ("codec", "prefill", "decode", "paired"):
        if stage not in deployment_stages(combo):
            continue
        spec = pod_spec(objects, stage)
        volume = next(v for v in spec["volumes"] if v["name"] == "model")
        if combo == "fetched-model":
            assert "emptyDir" in volume
        else:
            assert volume["persistentVolumeClaim"] == {"claimName": "kvrelay-models", "readOnly": True}
        for ctr in containers_of(deployment(objects, stage)):
            for m in ctr.get("volumeMounts") or []:
                if m["name"] == "model":
                    assert m.get("readOnly") is (ctr["name"] != "fetch-model"), (stage, ctr["name"])
    assert "model" not in json.dumps(pod_spec(objects, "router")["volumes"])


def test_model_version_is_apart_from_the_image_tag() -> None:
    base = render({"image": {"tag": "1.4.2"}, "model": {"version": "weights-a"}})
    moved = render({"image": {"tag": "1.4.2"}, "model": {"version": "weights-b"}})
    for stage in ("codec", "prefill", "decode"):
        a, b = container(base, stage), container(moved, stage)
        assert a["image"] == b["image"] and ":1.4.2" in a["image"]
        assert arg_value(a["args"], "--model") == "/models/weights-a"
        assert arg_value(b["args"], "--model") == "/models/weights-b"
        annotations = deployment(moved, stage)["spec"]["template"]["metadata"]["annotations"]
        assert annotations["kvrelay.dev/model-version"] == "weights-b"


def test_images_and_registry(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["everything"]
    assert container(objects, "codec")["image"] == "registry.example.com/ml/kvrelay-codec:1.4.2"
    assert container(objects, "router")["image"] == "registry.example.com/ml/kvrelay-router:1.4.2"
    assert container(objects, "decode")["image"] == "registry.example.com/ml/kvrelay-worker:1.4.2-cuda"
    for stage in chart.STAGES:
        assert pod_spec(objects, stage)["imagePullSecrets"] == [{"name": "regcred"}]


def test_verify_init_container_checks_manifest_and_fingerprint(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["everything"]
    for stage, scope in (("codec", "tokenizer"), ("prefill", "model"), ("decode", "model")):
        (init,) = pod_spec(objects, stage)["initContainers"]
        assert init["name"] == "verify-model" and init["command"] == ["kvrelay-verify-model"]
        assert init["image"] == container(objects, stage)["image"]
        assert init["args"] == ["/models/smollm2-v7", "--scope", scope, "--expect-fingerprint", FINGERPRINT]


def test_fetch_init_container_fills_the_model_volume(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["fetched-model"]
    for stage, scope in (("codec", "tokenizer"), ("decode", "model")):
        fetch, verify = pod_spec(objects, stage)["initContainers"]
        assert fetch["name"] == "fetch-model" and verify["name"] == "verify-model"
        env = env_of(fetch)
        assert env["KVRELAY_MODEL_DIR"]["value"] == "/models/smollm2-135m-instruct"
        assert env["KVRELAY_FETCH_SCOPE"]["value"] == scope
        assert fetch["command"][0] == "sh"
        assert verify["args"][-2:] == ["--expect-fingerprint", FINGERPRINT]
    with pytest.raises(Exception, match=r"model\.fetch\.command is required"):
        render({"model": {"fetch": {"enabled": True}}})


# -- security ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("combo", ["default", "everything"])
def test_pods_run_as_non_root_with_read_only_root(rendered: dict[str, list[dict]], combo: str) -> None:
    for d in find(rendered[combo], "Deployment"):
        spec = d["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        for ctr in containers_of(d):
            sc = ctr["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]


# -- ingress, metrics, dashboard -----------------------------------------------------------------------


def test_ingress_turns_off_buffering_for_streams(rendered: dict[str, list[dict]]) -> None:
    objects = rendered["everything"]
    ingress = one(objects, "Ingress", fullname("codec"))
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"
    assert annotations["nginx.ingress.kubernetes.io/proxy-request-buffering"] == "off"
    assert int(annotations["nginx.ingress.kubernetes.io/proxy-read-timeout"]) >= 600
    assert annotations["nginx.ingress.kubernetes.io/canary"] == "true"
    assert annotations["nginx.ingress.kubernetes.io/canary-weight"] == "20"
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert path["path"] == "/v1"  # /metrics and /status stay inside the cluster
    assert path["backend"]["service"] == {"name": fullname("codec"), "port": {"name": "http"}}
    assert not find(rendered["default"], "Ingress")


def test_service_monitor(rendered: dict[str, list[dict]]) -> None:
    (sm,) = find(rendered["everything"], "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "prometheus"
    # the codec's /metrics is on its metrics port (codec.metricsPort), like everyone else's
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("metrics", "/metrics")]
    selected = [
        s
        for s in find(rendered["everything"], "Service")
        if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()
    ]
    scraped = {
        s["metadata"]["name"] for s in selected if "metrics" in {p["name"] for p in s["spec"]["ports"]}
    }
    assert scraped == {fullname(s) for s in chart.STAGES}
    assert not find(rendered["default"], "ServiceMonitor")


def test_dashboard_config_map(default: list[dict]) -> None:
    found = find(default, "ConfigMap", fullname("dashboard"))
    assert len(found) == 1, f"the chart renders {len(found)} dashboard ConfigMaps; it reads {DASHBOARD}"
    (cm,) = found
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["kvrelay-dashboard.json"]) == json.loads(DASHBOARD.read_text())
    assert not find(
        render({"metrics": {"dashboard": {"enabled": False}}}), "ConfigMap", fullname("dashboard")
    )


def test_prometheus_rule(rendered: dict[str, list[dict]]) -> None:
    found = find(rendered["everything"], "PrometheusRule")
    assert len(found) == 1, f"the chart renders {len(found)} PrometheusRules; it reads {ALERTS}"
    (rule,) = found
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"]
    assert not find(rendered["default"], "PrometheusRule")
