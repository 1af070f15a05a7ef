"""Kubernetes NetworkPolicy semantics, enough to ask "may this pod reach that port?" of rendered policies.

Ingress (`allowed`): a pod selected by no Ingress policy accepts everything; a selected pod accepts a
connection when some rule of a policy selecting it matches both the source (podSelector /
namespaceSelector, ANDed within one peer; no `from` = anyone) and the port (by number or container port
name; no `ports` = any). Egress (`egress_allowed`) is the mirror image at the source: a pod selected by
no Egress policy may open anything; a selected one only what some `to` peer and port of a rule allow
(named ports name the destination's container ports). `reachable` needs both.

An Endpoint is a pod (a namespace, labels, named ports) or, with `namespace=None`, an address outside the
cluster, which only ipBlock peers match; ipBlock peers match no pod here.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    namespace: str | None  # None: outside the cluster (an API server, the internet), matched by ip
    labels: Mapping[str, str] = field(default_factory=dict)
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)  # container port name -> number
    ip: str | None = None


def outside(ip: str) -> Pod:
    """An address outside the cluster."""
    return Pod(None, ip=ip)


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and labels.get(key) in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], policy_namespace: str, other: Pod) -> bool:
    """Whether `peer` (of a policy in `policy_namespace`) names `other`, the far end of the connection."""
    if "ipBlock" in peer:
        if other.ip is None:
            return False
        address = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        excepted = any(address in ipaddress.ip_network(c) for c in block.get("except") or [])
        return address in ipaddress.ip_network(block["cidr"]) and not excepted
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], other.namespace_labels):
            return False
    elif other.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], other.labels)


def _port_matches(rule_ports: list[Mapping[str, Any]] | None, target: Pod, port: int, protocol: str) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        wanted = p["port"]
        number = target.ports.get(wanted) if isinstance(wanted, str) else wanted
        if number == port or (number is not None and p.get("endPort") and number <= port <= p["endPort"]):
            return True
    return False


def _selecting(policies: Sequence[Mapping[str, Any]], pod: Pod, policy_type: str) -> list[Mapping[str, Any]]:
    if pod.namespace is None:
        return []
    return [
        p
        for p in policies
        if p["metadata"].get("namespace", pod.namespace) == pod.namespace
        and policy_type in (p["spec"].get("policyTypes") or ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], pod.labels)
    ]


def _rules_allow(
    policies: Sequence[Mapping[str, Any]],
    direction: str,
    pod: Pod,
    other: Pod,
    target: Pod,
    port: int,
    protocol: str,
) -> bool:
    """Whether `pod`'s policies of `direction` ("ingress" or "egress") let a connection with `other` through
    to `target`'s `port`."""
    selecting = _selecting(policies, pod, direction.capitalize())
    if not selecting:
        return True
    peers_key = "from" if direction == "ingress" else "to"
    for policy in selecting:
        namespace = policy["metadata"].get("namespace", pod.namespace)
        for rule in policy["spec"].get(direction) or []:
            peers = rule.get(peers_key)
            if peers is not None and not any(_peer_matches(peer, namespace, other) for peer in peers):
                continue
            if _port_matches(rule.get("ports"), target, port, protocol):
                return True
    return False


def _number(target: Pod, port: int | str) -> int:
    return target.ports[port] if isinstance(port, str) else port


def allowed(
    policies: Sequence[Mapping[str, Any]], source: Pod, target: Pod, port: int | str, protocol: str = "TCP"
) -> bool:
    """Whether `target`'s ingress policies accept a connection from `source` to `port` (number or name)."""
    return _rules_allow(policies, "ingress", target, source, target, _number(target, port), protocol)


def egress_allowed(
    policies: Sequence[Mapping[str, Any]], source: Pod, target: Pod, port: int | str, protocol: str = "TCP"
) -> bool:
    """Whether `source`'s egress policies let it open a connection to `target`'s `port`."""
    return _rules_allow(policies, "egress", source, target, target, _number(target, port), protocol)


def reachable(
    policies: Sequence[Mapping[str, Any]], source: Pod, target: Pod, port: int | str, protocol: str = "TCP"
) -> bool:
    """Both ends agree: `source` may send, `target` may accept."""
    return egress_allowed(policies, source, target, port, protocol) and allowed(
        policies, source, target, port, protocol
    )


def rendered_pods(objects: Sequence[Mapping[str, Any]], namespace: str) -> dict[str, Pod]:
    """A pod of each rendered Deployment, by component label, with every container's named ports, plus
    "stranger" (same namespace, other labels), "other-namespace", "prometheus" (namespace monitoring),
    "otel-collector" (namespace monitoring), "kube-dns" (kube-system), and two addresses outside the
    cluster: "kube-apiserver" (172.18.0.2) and "internet" (93.184.216.34)."""
    ns_labels = {"kubernetes.io/metadata.name": namespace}
    out = {}
    for d in objects:
        if d["kind"] != "Deployment":
            continue
        component = d["metadata"]["labels"]["app.kubernetes.io/component"]
        template = d["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c["ports"]}
        out[component] = Pod(namespace, template["metadata"]["labels"], ns_labels, ports)
    out["stranger"] = Pod(namespace, {"app": "something-else"}, ns_labels)
    out["other-namespace"] = Pod("apps", {"app": "client"}, {"kubernetes.io/metadata.name": "apps"})
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    out["prometheus"] = Pod("monitoring", {"app": "prometheus"}, monitoring)
    out["otel-collector"] = Pod("monitoring", {"app": "otel-collector"}, monitoring, {"otlp-grpc": 4317})
    out["kube-dns"] = Pod(
        "kube-system", {"k8s-app": "kube-dns"}, {"kubernetes.io/metadata.name": "kube-system"}, {"dns": 53}
    )
    out["kube-apiserver"] = outside("172.18.0.2")
    out["internet"] = outside("93.184.216.34")
    return out
