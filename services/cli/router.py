"""`kvrelay router`: the router over workers from a static list or from Kubernetes EndpointSlices.

`--discovery static` (the default) takes `--workers`. `--discovery kubernetes` watches the EndpointSlices
of `--namespace` that match any `--selector` (one per stage, e.g. the prefill and the decode pool) and
uses their port named `--port-name`. Credentials: an explicit `--kubeconfig`; else the in-cluster service
account when KUBERNETES_SERVICE_HOST is set; else the default kubeconfig ($KUBECONFIG, ~/.kube/config).
"""

from __future__ import annotations

import argparse
import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.common.config import load_config
from services.common.errors import ConfigError
from services.common.logs import configure_logging

if TYPE_CHECKING:
    from services.router.discovery import KubernetesDiscovery

IN_CLUSTER_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="run the router (gRPC)")
    p.add_argument("--config", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--grace-seconds", type=float, default=30.0)
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port")
    p.add_argument(
        "--model-fingerprint",
        default=None,
        help="the pool's model directory (its manifest's model_fingerprint); workers of another are never "
        "used (default: the first to answer)",
    )
    p.add_argument("--discovery", choices=("static", "kubernetes"), default="static")
    p.add_argument("--workers", default=None, help="static: comma-separated HOST:PORT list")
    k8s = p.add_argument_group("kubernetes discovery")
    k8s.add_argument(
        "--namespace",
        default=None,
        help="the EndpointSlices' namespace (default: the router's own, or the kubeconfig context's)",
    )
    k8s.add_argument(
        "--selector",
        action="append",
        default=[],
        help="label selector on EndpointSlices, e.g. app.kubernetes.io/component=decode; repeat per stage",
    )
    k8s.add_argument("--port-name", default="grpc", help="the EndpointSlice port to use (default grpc)")
    k8s.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file (default: in-cluster when KUBERNETES_SERVICE_HOST is set, else $KUBECONFIG)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from services.router.server import RouterOptions, serve

    workers = [w.strip() for w in (args.workers or "").split(",") if w.strip()]
    discovery = discovery_from_args(args, workers)
    cfg = load_config(args.config)
    configure_logging("router", cfg.logging.for_service("router"))
    options = RouterOptions(
        args.host,
        args.port,
        workers,
        args.grace_seconds,
        args.model_fingerprint,
        cfg.disaggregation,
        discovery,
        cfg.router,
        args.metrics_port,
        cfg.internal_tls,
        cfg.tracing,
    )
    asyncio.run(serve(options))
    return 0


def discovery_from_args(args: argparse.Namespace, workers: list[str]) -> KubernetesDiscovery | None:
    """Check the discovery flags; the Kubernetes discovery they ask for, None for the static list."""
    if args.discovery == "static":
        if not workers:
            raise ConfigError("--discovery static needs --workers HOST:PORT[,HOST:PORT...]")
        return None
    return kubernetes_discovery(args)


def kubernetes_discovery(args: argparse.Namespace) -> KubernetesDiscovery:
    """A KubernetesDiscovery from the flags, with in-cluster or kubeconfig credentials."""
    from services.router.discovery import KubernetesDiscovery

    if not args.selector:
        raise ConfigError("--discovery kubernetes needs at least one --selector")
    try:
        from kubernetes import config
    except ImportError as exc:
        raise ConfigError("Kubernetes discovery needs the `kubernetes` package: kvrelay[router]") from exc
    in_cluster = args.kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    try:
        api_client = _in_cluster_client() if in_cluster else _kubeconfig_client(args.kubeconfig)
        namespace = args.namespace or _default_namespace(in_cluster, args.kubeconfig)
    except config.ConfigException as exc:
        raise ConfigError(f"no Kubernetes credentials: {exc}") from exc
    return KubernetesDiscovery(api_client, namespace, args.selector, args.port_name)


def _in_cluster_client() -> Any:
    from kubernetes import client, config

    configuration = client.Configuration()
    config.load_incluster_config(client_configuration=configuration)
    return client.ApiClient(configuration)


def _kubeconfig_client(kubeconfig: str | None) -> Any:
    from kubernetes import config

    return config.new_client_from_config(config_file=kubeconfig)


def _default_namespace(in_cluster: bool, kubeconfig: str | None) -> str:
    """The pod's own namespace in-cluster, else the kubeconfig context's; "default" when neither says."""
    from kubernetes import config

    if in_cluster:
        try:
            return IN_CLUSTER_NAMESPACE_FILE.read_text().strip() or "default"
        except OSError:
            return "default"
    _, active = config.list_kube_config_contexts(config_file=kubeconfig)
    return str((active.get("context") or {}).get("namespace") or "default")
