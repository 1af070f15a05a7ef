"""Kubernetes NetworkPolicy ingress semantics, enough to ask "may this pod reach that port?" of rendered
policies: a pod selected by no Ingress policy accepts everything; a selected pod accepts a connection
when some rule of a policy selecting it matches both the source (podSelector / namespaceSelector, ANDed
within one peer; no `from` = anyone) and the port (by number or container port name; no `ports` = any).
ipBlock peers match nothing here (the tests only ask about pods).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    namespace: str
    labels: Mapping[str, str]
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)  # container port name -> number


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


def _peer_matches(peer: Mapping[str, Any], policy_namespace: str, source: Pod) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], source.namespace_labels):
            return False
    elif source.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selector_matches(peer["podSelector"], source.labels)


def _port_matches(rule_ports: list[Mapping[str, Any]] | None, target: Pod, port: int) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p:
            return True
        wanted = p["port"]
        number = target.ports.get(wanted) if isinstance(wanted, str) else wanted
        if number == port or (number is not None and p.get("endPort") and number <= port <= p["endPort"]):
            return True
    return False


def allowed(policies: list[Mapping[str, Any]], source: Pod, target: Pod, port: int | str) -> bool:
    """Whether `source` may open a TCP connection to `target`'s `port` (a number or a port name)."""
    number = target.ports[port] if isinstance(port, str) else port
    selecting = [
        p
        for p in policies
        if p["metadata"].get("namespace", target.namespace) == target.namespace
        and "Ingress" in (p["spec"].get("policyTypes") or ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], target.labels)
    ]
    if not selecting:
        return True
    for policy in selecting:
        namespace = policy["metadata"].get("namespace", target.namespace)
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            if peers is not None and not any(_peer_matches(peer, namespace, source) for peer in peers):
                continue
            if _port_matches(rule.get("ports"), target, number):
                return True
    return False


def rendered_pods(objects: list[Mapping[str, Any]], namespace: str) -> dict[str, Pod]:
    """A pod of each rendered Deployment, by component label, with every container's named ports, plus
    "stranger" (same namespace, other labels), "other-namespace" and "prometheus" (namespace monitoring)."""
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
    return out
