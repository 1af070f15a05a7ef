"""The NetworkPolicies' egress rules, evaluated with the ingress rules (tests/deploy/netpol.py): between
kvrelay's own pods exactly the flows the stack needs get through, both ends agreeing; out of the cluster
only DNS, the Kubernetes API (the router), the OTLP endpoint (with tracing) and what
networkPolicy.extraEgress adds.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from tests.deploy.chart import NAMESPACE, find, render
from tests.deploy.netpol import Pod, egress_allowed, outside, reachable, rendered_pods

KVRELAY = ("codec", "router", "prefill", "decode", "paired", "redis")
TRACING = {"config": {"tracing": {"otlp_endpoint": "http://otel-collector.monitoring:4317"}}}
PAIRED_CPU = {
    "gpu": {"enabled": False},
    "paired": {"enabled": True},
    "config": {"disaggregation": {"transport": "ipc"}},
}
TORCH = {"config": {"disaggregation": {"transport": "torch"}}}

# (source, target, target's port name) of every connection the stack opens between its own pods.
FLOWS = {
    ("codec", "router", "grpc"),
    ("codec", "redis", "redis"),
    ("router", "prefill", "grpc"),
    ("router", "decode", "grpc"),
    ("decode", "prefill", "grpc"),  # the decode replica pulls the prompt's KV
}
PAIRED_FLOWS = FLOWS | {
    ("router", "paired", "prefill-grpc"),
    ("router", "paired", "decode-grpc"),
    ("decode", "paired", "prefill-grpc"),
    ("paired", "prefill", "grpc"),
    ("paired", "paired", "prefill-grpc"),  # another paired pod's prefill container
}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    combos: dict[str, dict[str, Any]] = {
        "default": {},
        "paired": PAIRED_CPU,
        "torch": TORCH,
        "tracing": TRACING,
        "narrow": {
            "networkPolicy": {
                "egress": {"kubernetesApi": {"cidrs": ["172.18.0.0/28"], "ports": [6443]}, "otlpTo": []}
            },
            **TRACING,
        },
        "otlp-to": {"networkPolicy": {"egress": {"otlpTo": [{"namespaceSelector": {}}]}}, **TRACING},
        "extra": {
            "redis": {"enabled": False, "external": {"url": "rediss://redis.example.com:6380/0"}},
            "networkPolicy": {
                "extraEgress": {
                    "codec": [{"to": [{"ipBlock": {"cidr": "10.9.9.9/32"}}], "ports": [{"port": 6380}]}],
                    "all": [{"to": [{"ipBlock": {"cidr": "10.8.0.0/16"}}], "ports": [{"port": 443}]}],
                }
            },
        },
        "off": {"networkPolicy": {"egress": {"enabled": False}}},
    }
    return {name: render(values) for name, values in combos.items()}


def setup(objects: list[dict]) -> tuple[list[dict], dict[str, Pod]]:
    return find(objects, "NetworkPolicy"), rendered_pods(objects, NAMESPACE)


def own_flows(objects: list[dict]) -> set[tuple[str, str, str]]:
    """Every (source, target, port name) between the release's pods that both ends let through."""
    policies, pods = setup(objects)
    present = [name for name in KVRELAY if name in pods]
    return {
        (src, dst, port)
        for src, dst in itertools.product(present, present)
        for port in pods[dst].ports
        if reachable(policies, pods[src], pods[dst], port)
    }


@pytest.mark.parametrize(("combo", "flows"), [("default", FLOWS), ("paired", PAIRED_FLOWS)])
def test_only_the_flows_the_stack_needs_get_through(
    rendered: dict[str, list[dict]], combo: str, flows: set[tuple[str, str, str]]
) -> None:
    """Nothing else: not the codec to a worker, not a worker to the router or Redis, not Redis anywhere."""
    assert own_flows(rendered[combo]) == flows


def test_torch_transport_opens_every_port_between_workers_both_ways(rendered: dict[str, list[dict]]) -> None:
    policies, pods = setup(rendered["torch"])
    for src, dst in (("prefill", "decode"), ("decode", "prefill")):
        for port in (29500, 41234):  # TCPStore, gloo/NCCL: ephemeral ports
            assert reachable(policies, pods[src], pods[dst], port), (src, dst, port)
    assert not reachable(policies, pods["codec"], pods["decode"], 29500)
    assert not reachable(policies, pods["router"], pods["decode"], 29500)
    assert not reachable(policies, pods["decode"], pods["router"], 29500)


@pytest.mark.parametrize("combo", ["default", "paired", "tracing"])
def test_every_kvrelay_pod_resolves_names_and_nothing_else_leaves(
    rendered: dict[str, list[dict]], combo: str
) -> None:
    policies, pods = setup(rendered[combo])
    for name in ("codec", "router", "prefill", "decode", "paired"):
        if name not in pods:
            continue
        for protocol in ("UDP", "TCP"):
            assert egress_allowed(policies, pods[name], pods["kube-dns"], 53, protocol), (name, protocol)
        assert not egress_allowed(policies, pods[name], pods["kube-dns"], 8080)
        assert not egress_allowed(policies, pods[name], pods["internet"], 80)
        assert not egress_allowed(policies, pods[name], pods["stranger"], 8080)
        assert not egress_allowed(policies, pods[name], pods["other-namespace"], 8000)
        if name != "router":
            assert not egress_allowed(policies, pods[name], pods["kube-apiserver"], 443), name
    assert not egress_allowed(policies, pods["redis"], pods["kube-dns"], 53, "UDP")  # Redis talks to no one


def test_router_reaches_the_kubernetes_api(rendered: dict[str, list[dict]]) -> None:
    policies, pods = setup(rendered["default"])
    for port in (443, 6443):  # the API servers' own addresses: policies see the translated destination
        assert egress_allowed(policies, pods["router"], pods["kube-apiserver"], port)
    assert not egress_allowed(policies, pods["router"], pods["kube-apiserver"], 10250)  # not the kubelets
    policies, pods = setup(rendered["narrow"])  # kubernetesApi.cidrs and ports narrowed
    assert egress_allowed(policies, pods["router"], pods["kube-apiserver"], 6443)
    assert not egress_allowed(policies, pods["router"], pods["kube-apiserver"], 443)
    assert not egress_allowed(policies, pods["router"], pods["internet"], 6443)


def test_tracing_opens_the_otlp_port_only(rendered: dict[str, list[dict]]) -> None:
    policies, pods = setup(rendered["default"])
    assert not egress_allowed(policies, pods["codec"], pods["otel-collector"], 4317)
    policies, pods = setup(rendered["tracing"])
    for name in ("codec", "router", "prefill", "decode"):  # every service exports its own spans
        assert reachable(policies, pods[name], pods["otel-collector"], "otlp-grpc"), name
        assert not egress_allowed(policies, pods[name], pods["otel-collector"], 4318)
    assert not egress_allowed(policies, pods["redis"], pods["otel-collector"], 4317)
    # networkPolicy.egress.otlpTo narrows where: here any namespace's pods, so no address outside
    policies, pods = setup(rendered["otlp-to"])
    assert egress_allowed(policies, pods["codec"], pods["otel-collector"], 4317)
    assert not egress_allowed(policies, pods["codec"], outside("93.184.216.34"), 4317)


def test_extra_egress_per_component_and_for_all(rendered: dict[str, list[dict]]) -> None:
    policies, pods = setup(rendered["extra"])
    external_redis = outside("10.9.9.9")
    assert egress_allowed(policies, pods["codec"], external_redis, 6380)
    assert not egress_allowed(policies, pods["router"], external_redis, 6380)
    object_store = outside("10.8.1.2")
    for name in ("codec", "router", "prefill", "decode"):
        assert egress_allowed(policies, pods[name], object_store, 443), name


def test_egress_rules_can_be_turned_off(rendered: dict[str, list[dict]]) -> None:
    policies, pods = setup(rendered["off"])
    assert all(p["spec"]["policyTypes"] == ["Ingress"] and "egress" not in p["spec"] for p in policies)
    assert egress_allowed(policies, pods["codec"], pods["internet"], 443)
    assert not reachable(policies, pods["codec"], pods["decode"], "grpc")  # ingress still holds
