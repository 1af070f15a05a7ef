"""Router discovery: EndpointSlices -> endpoints (pure), static lists, and Kubernetes list + watch through
the official client against a stand-in API server (resourceVersion, conditions, dropped watches, 410)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from services.cli.main import build_parser
from services.cli.router import discovery_from_args, kubernetes_discovery
from services.common.errors import ConfigError
from services.common.grpc_auth import TokenSource
from services.router.discovery import (
    KubernetesDiscovery,
    StaticDiscovery,
    endpoints_from_slices,
    is_gone,
)
from services.router.replicas import Endpoint, ReplicaSet
from tests.k8s_stand_in import K8sStandIn, matches, slice_endpoint

DECODE = {"app.kubernetes.io/component": "decode"}
PREFILL = {"app.kubernetes.io/component": "prefill"}
DECODE_SELECTOR = "app.kubernetes.io/component=decode"
PREFILL_SELECTOR = "app.kubernetes.io/component=prefill"


def endpoint_slice(name: str, endpoints: list[dict[str, Any]], port: int = 50051, **extra: Any) -> dict:
    return {
        "metadata": {"name": name},
        "addressType": "IPv4",
        "endpoints": endpoints,
        "ports": [{"name": "grpc", "port": port, "protocol": "TCP"}],
        **extra,
    }


# -- the pure conversion ----------------------------------------------------------------------------------


def test_missing_conditions_mean_ready_serving_and_not_terminating() -> None:
    entry = {"addresses": ["10.0.0.1"], "targetRef": {"kind": "Pod", "name": "decode-0"}}
    assert endpoints_from_slices([endpoint_slice("s", [entry])], "grpc") == [
        Endpoint("10.0.0.1:50051", "decode-0", ready=True, serving=True, terminating=False)
    ]


def test_serving_defaults_to_ready() -> None:
    entry = slice_endpoint("10.0.0.1", "decode-0", ready=False)
    [endpoint] = endpoints_from_slices([endpoint_slice("s", [entry])], "grpc")
    assert (endpoint.ready, endpoint.serving, endpoint.accepts_new_requests) == (False, False, False)


def test_a_terminating_endpoint_that_still_serves_takes_no_new_requests() -> None:
    entry = slice_endpoint("10.0.0.1", "decode-0", ready=False, serving=True, terminating=True)
    [endpoint] = endpoints_from_slices([endpoint_slice("s", [entry])], "grpc")
    assert endpoint.serving and endpoint.terminating and not endpoint.accepts_new_requests


def test_the_port_is_chosen_by_name_and_slices_without_it_are_skipped() -> None:
    two_ports = endpoint_slice("a", [slice_endpoint("10.0.0.1", "p1")])
    two_ports["ports"] = [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": 7000}]
    no_grpc = endpoint_slice("b", [slice_endpoint("10.0.0.2", "p2")])
    no_grpc["ports"] = [{"name": "metrics", "port": 9090}]
    assert [e.address for e in endpoints_from_slices([two_ports, no_grpc], "grpc")] == ["10.0.0.1:7000"]
    unnamed = endpoint_slice("c", [slice_endpoint("10.0.0.3", "p3")])
    unnamed["ports"] = [{"port": 8000}]
    assert [e.address for e in endpoints_from_slices([unnamed], "")] == ["10.0.0.3:8000"]


def test_names_come_from_the_pod_else_the_address_and_ipv6_is_bracketed() -> None:
    entries = [
        {"addresses": ["fd00::1", "fd00::2"]},  # fungible addresses: the first is used
        {"addresses": ["10.0.0.9"], "targetRef": {"kind": "Pod", "name": "decode-a"}},
        {"addresses": []},
    ]
    got = endpoints_from_slices([endpoint_slice("s", entries), endpoint_slice("empty", None)], "grpc")  # type: ignore[arg-type]
    assert [(e.name, e.address) for e in got] == [
        ("decode-a", "10.0.0.9:50051"),
        ("fd00::1", "[fd00::1]:50051"),
    ]


def test_an_address_in_two_slices_counts_once_preferring_the_entry_that_accepts_requests() -> None:
    old = endpoint_slice("old", [slice_endpoint("10.0.0.1", "p1", ready=False, terminating=True)])
    new = endpoint_slice("new", [slice_endpoint("10.0.0.1", "p1")])
    assert endpoints_from_slices([old, new], "grpc") == [Endpoint("10.0.0.1:50051", "p1")]
    assert endpoints_from_slices([new, old], "grpc") == [Endpoint("10.0.0.1:50051", "p1")]


def test_two_endpoints_of_one_pod_are_named_after_the_pod_and_their_port() -> None:
    """The chart's paired pods: a prefill and a decode container, one pod IP, two Services (two slices)."""
    prefill = endpoint_slice("paired-prefill-x", [slice_endpoint("10.0.0.7", "paired-0")], port=50051)
    decode = endpoint_slice("paired-decode-y", [slice_endpoint("10.0.0.7", "paired-0")], port=50052)
    alone = endpoint_slice("decode-z", [slice_endpoint("10.0.0.8", "decode-0")], port=50051)
    assert [(e.name, e.address) for e in endpoints_from_slices([decode, alone, prefill], "grpc")] == [
        ("decode-0", "10.0.0.8:50051"),
        ("paired-0:50051", "10.0.0.7:50051"),
        ("paired-0:50052", "10.0.0.7:50052"),
    ]
    # one address listed in two slices is still one endpoint, named after its pod alone
    moved = endpoint_slice("paired-prefill-w", [slice_endpoint("10.0.0.7", "paired-0")], port=50051)
    assert [e.name for e in endpoints_from_slices([prefill, moved], "grpc")] == ["paired-0"]


def test_gone_is_a_410_status() -> None:
    from kubernetes.client.exceptions import ApiException

    assert is_gone(ApiException(status=410))
    assert not is_gone(ApiException(status=500))
    assert not is_gone(OSError("reset"))


def test_the_stand_in_matches_equality_selectors() -> None:
    labels = {"app": "kvrelay", "tier": "decode"}
    assert matches("app=kvrelay,tier==decode", labels)
    assert matches("app,tier!=prefill", labels)
    assert not matches("tier=prefill", labels)
    assert not matches("zone", labels)


# -- static -----------------------------------------------------------------------------------------------


async def test_static_discovery_reports_its_list_once_and_runs_until_cancelled() -> None:
    seen: list[list[Endpoint]] = []
    reported = asyncio.Event()

    def on_change(endpoints: list[Endpoint]) -> None:
        seen.append(endpoints)
        reported.set()

    task = asyncio.create_task(StaticDiscovery(["h:1", "h:2"]).run(on_change))
    await asyncio.wait_for(reported.wait(), 5.0)
    for _ in range(20):  # loop turns in which a second report, or the end of `run`, would show
        await asyncio.sleep(0)
    assert seen == [[Endpoint("h:1", "worker-0"), Endpoint("h:2", "worker-1")]]
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


# -- Kubernetes against the stand-in ----------------------------------------------------------------------


class Observer:
    """Collects on_change calls; waits for one that satisfies a predicate."""

    def __init__(self) -> None:
        self.changes: list[list[Endpoint]] = []

    def __call__(self, endpoints: list[Endpoint]) -> None:
        self.changes.append(endpoints)

    @property
    def latest(self) -> dict[str, Endpoint]:
        return {e.name: e for e in (self.changes[-1] if self.changes else [])}

    async def until(self, predicate: Callable[[dict[str, Endpoint]], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.latest):
            assert time.monotonic() < deadline, f"discovery never got there; last: {self.latest}"
            await asyncio.sleep(0.02)


@pytest.fixture
def api() -> Iterator[K8sStandIn]:
    with K8sStandIn() as stand_in:
        yield stand_in


@contextlib.asynccontextmanager
async def discovering(
    api: K8sStandIn, selectors: list[str], also: Callable[[list[Endpoint]], None] | None = None
) -> AsyncIterator[Observer]:
    """Run KubernetesDiscovery against the stand-in; its changes go to the yielded Observer (and `also`)."""
    observer = Observer()

    def on_change(endpoints: list[Endpoint]) -> None:
        observer(endpoints)
        if also is not None:
            also(endpoints)

    discovery = KubernetesDiscovery(api.api_client(), "default", selectors, "grpc", watch_timeout_s=30)
    task = asyncio.create_task(discovery.run(on_change))
    try:
        yield observer
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_watching(api: K8sStandIn, num_watches: int = 1) -> None:
    await asyncio.to_thread(api.wait_until, lambda: len(api._watchers) >= num_watches)


async def test_the_initial_list_then_added_modified_and_deleted_slices(api: K8sStandIn) -> None:
    api.put_slice("decode-a", [slice_endpoint("10.0.0.1:7000", "decode-0")], DECODE)
    async with discovering(api, [DECODE_SELECTOR]) as seen:
        await seen.until(lambda e: set(e) == {"decode-0"})
        await wait_watching(api)
        assert api.watch_calls[0]["resourceVersion"] == "2"  # the list's: one change after the start
        api.put_slice(
            "decode-a",
            [slice_endpoint("10.0.0.1:7000", "decode-0"), slice_endpoint("10.0.0.2:7000", "decode-1")],
            DECODE,
        )
        await seen.until(lambda e: set(e) == {"decode-0", "decode-1"})
        api.put_slice("decode-b", [slice_endpoint("10.0.0.3:7000", "decode-2")], DECODE)
        await seen.until(lambda e: set(e) == {"decode-0", "decode-1", "decode-2"})
        assert seen.latest["decode-2"].address == "10.0.0.3:7000"
        api.delete_slice("decode-a")
        await seen.until(lambda e: set(e) == {"decode-2"})
    assert len(api.list_calls) == 1
    assert api.list_calls[0]["labelSelector"] == DECODE_SELECTOR


async def test_terminating_and_not_ready_endpoints_take_no_new_requests(api: K8sStandIn) -> None:
    pods = [slice_endpoint("10.0.0.1:7000", "decode-0"), slice_endpoint("10.0.0.2:7000", "decode-1")]
    api.put_slice("decode-a", pods, DECODE)
    async with discovering(api, [DECODE_SELECTOR]) as seen:
        await seen.until(lambda e: len(e) == 2)
        terminating = slice_endpoint("10.0.0.1:7000", "decode-0", ready=False, serving=True, terminating=True)
        not_ready = slice_endpoint("10.0.0.2:7000", "decode-1", ready=False)
        api.put_slice("decode-a", [terminating, not_ready], DECODE)
        await seen.until(lambda e: not any(x.accepts_new_requests for x in e.values()))
        assert seen.latest["decode-0"] == Endpoint("10.0.0.1:7000", "decode-0", False, True, True)
        assert seen.latest["decode-1"] == Endpoint("10.0.0.2:7000", "decode-1", False, False, False)
        api.put_slice("decode-a", [slice_endpoint("10.0.0.2:7000", "decode-1")], DECODE)
        await seen.until(lambda e: set(e) == {"decode-1"} and e["decode-1"].accepts_new_requests)


@pytest.mark.parametrize("how", ["drop", "end"])
async def test_a_watch_that_drops_or_ends_resumes_from_the_last_resource_version(
    api: K8sStandIn, how: str
) -> None:
    api.put_slice("decode-a", [slice_endpoint("10.0.0.1:7000", "decode-0")], DECODE)
    async with discovering(api, [DECODE_SELECTOR]) as seen:
        await wait_watching(api)
        added = api.put_slice("decode-b", [slice_endpoint("10.0.0.2:7000", "decode-1")], DECODE)
        await seen.until(lambda e: set(e) == {"decode-0", "decode-1"})
        api.drop_watches() if how == "drop" else api.end_watches()
        await asyncio.to_thread(api.wait_until, lambda: len(api.watch_calls) == 2 and len(api._watchers) == 1)
        assert api.watch_calls[1]["resourceVersion"] == added["metadata"]["resourceVersion"]
        api.delete_slice("decode-a")
        await seen.until(lambda e: set(e) == {"decode-1"})
    assert len(api.list_calls) == 1  # resumed, not re-listed


@pytest.mark.parametrize("how", ["http", "event"])
async def test_a_410_gone_forces_a_fresh_list(api: K8sStandIn, how: Any) -> None:
    api.put_slice("decode-a", [slice_endpoint("10.0.0.1:7000", "decode-0")], DECODE)
    api.put_slice("decode-b", [slice_endpoint("10.0.0.2:7000", "decode-1")], DECODE)
    async with discovering(api, [DECODE_SELECTOR]) as seen:
        await wait_watching(api)
        await seen.until(lambda e: len(e) == 2)
        api.expire_next_watch(how)
        # Changes whose events the watch never sees (compacted away): only a new list shows them.
        api.delete_slice("decode-a", silent=True)
        api.put_slice("decode-c", [slice_endpoint("10.0.0.3:7000", "decode-2")], DECODE, silent=True)
        api.end_watches()
        await seen.until(lambda e: set(e) == {"decode-1", "decode-2"})
        assert len(api.list_calls) == 2
        await asyncio.to_thread(api.wait_until, lambda: len(api._watchers) == 1)
        assert api.watch_calls[-1]["resourceVersion"] == str(api.version)  # the new list's
        api.put_slice("decode-a", [slice_endpoint("10.0.0.1:7000", "decode-0")], DECODE)
        await seen.until(lambda e: set(e) == {"decode-0", "decode-1", "decode-2"})


async def test_several_selectors_merge_and_other_labels_or_namespaces_are_ignored(api: K8sStandIn) -> None:
    api.put_slice("prefill-a", [slice_endpoint("10.0.1.1:7000", "prefill-0")], PREFILL)
    api.put_slice("decode-a", [slice_endpoint("10.0.2.1:7000", "decode-0")], DECODE)
    api.put_slice(
        "codec-a", [slice_endpoint("10.0.3.1:7000", "codec-0")], {"app.kubernetes.io/component": "x"}
    )
    api.put_slice("decode-z", [slice_endpoint("10.0.4.1:7000", "other-0")], DECODE, namespace="other")
    async with discovering(api, [PREFILL_SELECTOR, DECODE_SELECTOR]) as seen:
        await seen.until(lambda e: set(e) == {"prefill-0", "decode-0"})
        await wait_watching(api, 2)
        api.delete_slice("prefill-a")
        api.put_slice("decode-b", [slice_endpoint("10.0.2.2:7000", "decode-1")], DECODE)
        await seen.until(lambda e: set(e) == {"decode-0", "decode-1"})
    assert sorted(c["labelSelector"] for c in api.list_calls) == [DECODE_SELECTOR, PREFILL_SELECTOR]


async def test_list_errors_are_retried_and_cancelling_stops_the_watch_threads(api: K8sStandIn) -> None:
    api.put_slice("decode-a", [slice_endpoint("10.0.0.1:7000", "decode-0")], DECODE)
    api.fail_next_lists(2)
    async with discovering(api, [DECODE_SELECTOR]) as seen:
        await seen.until(lambda e: set(e) == {"decode-0"})
        assert len(api.list_calls) == 3
        await wait_watching(api)
    await asyncio.to_thread(api.wait_until, lambda: not api._watchers)
    deadline = time.monotonic() + 5
    while any(t.name.startswith("k8s-watch") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "watch threads still running after cancel"
        await asyncio.sleep(0.05)


async def test_discovery_drains_replicas_in_a_replica_set(api: K8sStandIn) -> None:
    replicas = ReplicaSet([], TokenSource("t"), watch_kv_events=False)
    api.put_slice(
        "decode-a",
        [slice_endpoint("127.0.0.1:1", "decode-0"), slice_endpoint("127.0.0.2:1", "decode-1")],
        DECODE,
    )
    async with discovering(api, [DECODE_SELECTOR], replicas.apply) as seen:
        await seen.until(lambda e: len(e) == 2)
        assert [(r.name, r.draining) for r in replicas.replicas] == [("decode-0", False), ("decode-1", False)]
        replicas.replicas[0].in_flight = 1  # a request still running on decode-0
        gone = slice_endpoint("127.0.0.1:1", "decode-0", ready=False, serving=True, terminating=True)
        api.put_slice("decode-a", [gone, slice_endpoint("127.0.0.2:1", "decode-1")], DECODE)
        await seen.until(lambda e: e["decode-0"].terminating)
        assert [(r.name, r.draining) for r in replicas.replicas] == [("decode-0", True), ("decode-1", False)]
        api.put_slice("decode-a", [slice_endpoint("127.0.0.2:1", "decode-1")], DECODE)
        await seen.until(lambda e: set(e) == {"decode-1"})
        assert [(r.name, r.gone) for r in replicas.replicas] == [("decode-0", True), ("decode-1", False)]
        replicas.replicas[0].in_flight = 0  # it finished: dropped at the next refresh
        await replicas.refresh()
        assert [r.name for r in replicas.replicas] == ["decode-1"]
    await replicas.close()


# -- the CLI ----------------------------------------------------------------------------------------------


def router_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["router", "--port", "1", *argv])


def test_cli_builds_kubernetes_discovery_from_a_kubeconfig(
    api: K8sStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")  # an explicit --kubeconfig wins
    kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig", namespace="serving")
    args = router_args(
        "--discovery",
        "kubernetes",
        "--selector",
        PREFILL_SELECTOR,
        "--selector",
        DECODE_SELECTOR,
        "--kubeconfig",
        str(kubeconfig),
    )
    discovery = kubernetes_discovery(args)
    assert (discovery.namespace, discovery.selectors, discovery.port_name) == (
        "serving",
        [PREFILL_SELECTOR, DECODE_SELECTOR],
        "grpc",
    )
    assert discovery.api.api_client.configuration.host == api.url
    args = router_args(
        *("--discovery", "kubernetes", "--selector", "a=b", "--kubeconfig", str(kubeconfig)),
        *("--namespace", "ns", "--port-name", "rpc"),
    )
    discovery = kubernetes_discovery(args)
    assert (discovery.namespace, discovery.port_name) == ("ns", "rpc")


def test_cli_uses_the_in_cluster_account_when_kubernetes_service_host_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def load_incluster_config(client_configuration: Any) -> None:
        client_configuration.host = "https://10.96.0.1:443"

    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setattr("kubernetes.config.load_incluster_config", load_incluster_config)
    (tmp_path / "namespace").write_text("kvrelay\n")
    monkeypatch.setattr("services.cli.router.IN_CLUSTER_NAMESPACE_FILE", tmp_path / "namespace")
    discovery = kubernetes_discovery(router_args("--discovery", "kubernetes", "--selector", "a=b"))
    assert discovery.api.api_client.configuration.host == "https://10.96.0.1:443"
    assert discovery.namespace == "kvrelay"  # the pod's own


def test_cli_flag_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ConfigError, match="--workers"):
        discovery_from_args(router_args(), [])
    assert discovery_from_args(router_args("--workers", "h:1"), ["h:1"]) is None
    with pytest.raises(ConfigError, match="--selector"):
        discovery_from_args(router_args("--discovery", "kubernetes"), [])
    assert router_args().discovery == "static"
