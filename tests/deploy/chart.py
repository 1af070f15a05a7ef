"""Rendering deploy/helm/kvrelay with Helm (the helm-python-sdk package: Helm v4 as a library, no binary,
no cluster, no network) and validating what it renders against the Kubernetes schemas.

`render(values)` returns the rendered objects as dicts, in template order, for `values` over BASE_VALUES
(API keys from an existing Secret, which the chart requires unless auth.allowOpen): a test that sets
`auth` replaces BASE_VALUES' `auth` whole, and `base=False` renders the chart's own defaults alone.
`validate(obj)` checks one object against the OpenAPI-derived JSON schema that `kubernetes-validate`
ships for KUBE_VERSION, in strict mode (an unknown field is an error); objects of kinds Kubernetes itself
does not define (the Prometheus Operator's, cert-manager's) are listed in CRD_KINDS and checked by the
tests instead.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "kvrelay"
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "kvrelay-dashboard.json"
ALERTS = REPO_ROOT / "deploy" / "prometheus" / "kvrelay-alerts.yaml"

# The Kubernetes version the schemas are pinned to: the newest minor kubernetes-validate 1.37.0 ships
# that the chart targets as "current". MIN_KUBE_VERSION is the chart's kubeVersion floor; every object
# validates against both.
KUBE_VERSION = "1.33.0"
MIN_KUBE_VERSION = "1.29.0"
CRD_KINDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("cert-manager.io/v1", "Certificate"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),  # gateway_errors: the Gateway API's own schema
    ("gateway.networking.k8s.io/v1", "GRPCRoute"),
}
# The Gateway API's HTTPRoute and GRPCRoute schemas (v1.3.0, standard channel), vendored.
GATEWAY_SCHEMAS = Path(__file__).with_name("gateway-api-routes.schema.json")

RELEASE = "kv"
NAMESPACE = "serving"
STAGES = ("codec", "router", "prefill", "decode")
KEYS_SECRET = "kvrelay-api-keys"
BASE_VALUES: dict[str, Any] = {"auth": {"existingSecret": KEYS_SECRET}}


def with_base(values: Mapping[str, Any] | None) -> dict[str, Any]:
    """`values` over BASE_VALUES, top-level keys replaced whole."""
    return {**BASE_VALUES, **(values or {})}


def render(
    values: Mapping[str, Any] | None = None,
    name: str = RELEASE,
    namespace: str = NAMESPACE,
    *,
    base: bool = True,
) -> list[dict]:
    """Every object the chart renders for `values` (merged over values.yaml), as an install would."""
    import helm_python as helm

    values = with_base(values) if base else dict(values or {})
    with helm.Chart.load(CHART_DIR) as chart:
        chart.validate_schema(chart.merge_values(values))  # values.schema.json
        manifests = chart.render(values, name=name, namespace=namespace, is_install=True)
    objects: list[dict] = []
    for path in sorted(manifests):
        if not path.endswith((".yaml", ".yml")):
            continue  # NOTES.txt
        objects.extend(obj for obj in yaml.safe_load_all(manifests[path]) if obj)
    return objects


def helm_error() -> type[Exception]:
    """What a render the chart refuses (`fail`) or the schema rejects raises."""
    import helm_python as helm

    return helm.HelmError


def render_notes(values: Mapping[str, Any] | None = None) -> str:
    import helm_python as helm

    with helm.Chart.load(CHART_DIR) as chart:
        manifests = chart.render(with_base(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    return next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))


@functools.cache
def _validator(api_version: str, kind: str, version: str) -> Any:
    """A strict Draft 2020-12 validator for one kind at one Kubernetes version (schemas loaded once)."""
    import jsonschema
    from kubernetes_validate import utils
    from referencing import Registry, Resource

    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    minor = utils.major_minor(version)
    schema_version = [v for v in utils.all_versions() if utils.major_minor(v) <= minor][-1]
    directory = f"kubernetes-json-schema/v{schema_version}-local-strict"
    schema = utils.schema_contents(f"{directory}/{kind.lower()}-{group}.json", version)
    definitions = utils.schema_contents(f"{directory}/_definitions.json", version)
    registry = Resource.from_contents(definitions) @ (Resource.from_contents(schema) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


def validation_errors(obj: Mapping[str, Any], version: str = KUBE_VERSION) -> list[str]:
    """Every schema violation of `obj` at `version`, as "path: message"; empty when it is valid."""
    validator = _validator(obj["apiVersion"], obj["kind"], version)
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in validator.iter_errors(dict(obj))
    ]


def gateway_errors(obj: Mapping[str, Any]) -> list[str]:
    """Every violation of a rendered HTTPRoute or GRPCRoute against the Gateway API's own CRD schema."""
    import json

    import jsonschema

    schema = json.loads(GATEWAY_SCHEMAS.read_text())[obj["kind"]]
    return [
        f"{'.'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in jsonschema.Draft7Validator(schema).iter_errors(dict(obj))
    ]


# -- finding things in the rendered objects ----------------------------------------------------------


def fullname(stage: str, release: str = RELEASE) -> str:
    return f"{release}-{stage}"


def find(objects: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict], kind: str, name: str) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def deployment(objects: list[dict], stage: str) -> dict:
    return one(objects, "Deployment", fullname(stage))


def pod_spec(objects: list[dict], stage: str) -> dict:
    return deployment(objects, stage)["spec"]["template"]["spec"]


def container(objects: list[dict], stage: str) -> dict:
    containers = pod_spec(objects, stage)["containers"]
    assert len(containers) == 1
    return containers[0]


def paired_container(objects: list[dict], role: str) -> dict:
    """The paired pod's container for `role` (prefill or decode)."""
    found = [c for c in pod_spec(objects, "paired")["containers"] if c["name"] == role]
    assert len(found) == 1, f"expected one {role} container in the paired pod, found {len(found)}"
    return found[0]


def env_of(ctr: Mapping[str, Any]) -> dict[str, dict]:
    return {e["name"]: e for e in ctr.get("env") or []}


def effective_config_env(ctr: Mapping[str, Any]) -> dict[str, str]:
    """The container's environment as `load_config` would see it (references to Secrets as a stand-in)."""
    return {k: e.get("value", "redis://from-a-secret:6379/0") for k, e in env_of(ctr).items()}


def secret_env(ctr: Mapping[str, Any], name: str) -> dict[str, str]:
    """The Secret and key an env entry of `ctr` comes from."""
    return env_of(ctr)[name]["valueFrom"]["secretKeyRef"]


def containers_of(obj: Mapping[str, Any]) -> Iterator[dict]:
    spec = obj["spec"]["template"]["spec"]
    yield from spec.get("initContainers") or []
    yield from spec["containers"]


def config_yaml(objects: list[dict]) -> str:
    return one(objects, "ConfigMap", fullname("config"))["data"]["config.yaml"]


def arg_value(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} not in {args}"
    return args[args.index(flag) + 1]


def arg_values(args: list[str], flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def container_port(ctr: Mapping[str, Any], port: int | str) -> int:
    """A probe's port (a number or a container port's name) as the container port number it names."""
    if isinstance(port, int):
        assert any(p["containerPort"] == port for p in ctr["ports"]), f"port {port} not declared"
        return port
    for p in ctr["ports"]:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise AssertionError(f"no container port named {port!r}")
