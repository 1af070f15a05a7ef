"""Where the router's replicas are: a static list, or Kubernetes EndpointSlices watched by label.

Both kinds expose `run(on_change)`, which calls `on_change` with the full list of endpoints whenever it
changes (the router passes `ReplicaSet.apply`) and runs until cancelled.

Kubernetes: for each label selector (one per stage, e.g. the prefill and the decode pool), list the
namespace's EndpointSlices, then watch from the list's resourceVersion, so `kubectl scale` adds or drains
replicas without a restart. Each endpoint's first address and the port named `port_name` make one
replica, named after its pod (targetRef; `<pod>:<port>` for a pod with several endpoints, such as the
chart's paired pods, whose prefill and decode containers sit behind two Services), with its ready /
serving / terminating conditions: an endpoint that is terminating or not ready gets no new requests, and
its in-flight requests finish. A watch that ends or drops resumes from the last resourceVersion seen; one
that answers 410 Gone (an HTTP 410 or an ERROR event with code 410) makes the router list again. Other
errors are retried with a backoff, keeping the last known membership meanwhile.

The official client is synchronous: each selector is listed and watched in its own daemon thread, which
hands every new membership to the event loop. Cancelling `run` stops the watches (and each watch also
ends by itself after WATCH_TIMEOUT_S).

RBAC: the router's service account needs get, list and watch on endpointslices in the API group
discovery.k8s.io, in its namespace (a Role and a RoleBinding):

    rules:
      - apiGroups: ["discovery.k8s.io"]
        resources: ["endpointslices"]
        verbs: ["get", "list", "watch"]
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from services.router.replicas import Endpoint

log = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; the router watches again at once
CONNECT_TIMEOUT_S = 10.0
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 30.0
HTTP_GONE = 410

OnChange = Callable[[list[Endpoint]], None]
EndpointSlice = Mapping[str, Any]  # one EndpointSlice as the API serves it (JSON, camelCase keys)


class Discovery(Protocol):
    async def run(self, on_change: OnChange) -> None:
        """Call `on_change` with every new list of endpoints until cancelled."""


class StaticDiscovery:
    """A fixed list of HOST:PORT addresses, all ready, named worker-0, worker-1, ..."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self.endpoints = [Endpoint(address, f"worker-{i}") for i, address in enumerate(addresses)]

    async def run(self, on_change: OnChange) -> None:
        on_change(list(self.endpoints))
        await asyncio.Event().wait()  # nothing ever changes


# -- EndpointSlices -> endpoints (pure) ---------------------------------------------------------------


def slice_port(endpoint_slice: EndpointSlice, port_name: str) -> int | None:
    """The number of the slice's port named `port_name` ("" matches an unnamed port); None if absent."""
    for port in endpoint_slice.get("ports") or []:
        if (port.get("name") or "") == port_name and port.get("port") is not None:
            return int(port["port"])
    return None


def endpoint_from_slice_entry(entry: Mapping[str, Any], port: int) -> Endpoint | None:
    """One EndpointSlice endpoint as a replica; None when it has no address.

    API semantics: a missing `ready` means ready, a missing `serving` means the same as ready, a missing
    `terminating` means not terminating. The addresses are fungible, so the first one is used.
    """
    addresses = entry.get("addresses") or []
    if not addresses:
        return None
    host = str(addresses[0])
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    conditions = entry.get("conditions") or {}
    ready = conditions.get("ready")
    ready = True if ready is None else bool(ready)
    serving = conditions.get("serving")
    serving = ready if serving is None else bool(serving)
    target = entry.get("targetRef") or {}
    return Endpoint(
        address=address,
        name=str(target.get("name") or host),
        ready=ready,
        serving=serving,
        terminating=bool(conditions.get("terminating")),
    )


def endpoints_from_slices(slices: Iterable[EndpointSlice], port_name: str) -> list[Endpoint]:
    """The replicas in these EndpointSlices: one per address:port, sorted by name then address.

    Slices without the named port are skipped. An address listed twice (a pod moving between slices)
    counts once, as its entry that accepts new requests if any does. A pod with several endpoints (the
    prefill and decode containers of one pod, behind two Services) names each one `<pod>:<port>`.
    """
    by_address: dict[str, tuple[Endpoint, int]] = {}
    for endpoint_slice in slices:
        port = slice_port(endpoint_slice, port_name)
        if port is None:
            continue
        for entry in endpoint_slice.get("endpoints") or []:
            endpoint = endpoint_from_slice_entry(entry, port)
            if endpoint is None:
                continue
            known = by_address.get(endpoint.address)
            if known is None or (endpoint.accepts_new_requests and not known[0].accepts_new_requests):
                by_address[endpoint.address] = (endpoint, port)
    num_per_name = collections.Counter(e.name for e, _ in by_address.values())
    endpoints = [
        dataclasses.replace(e, name=f"{e.name}:{port}") if num_per_name[e.name] > 1 else e
        for e, port in by_address.values()
    ]
    return sorted(endpoints, key=lambda e: (e.name, e.address))


def slice_name(endpoint_slice: EndpointSlice) -> str:
    return str((endpoint_slice.get("metadata") or {}).get("name") or "")


def resource_version(obj: Mapping[str, Any]) -> str | None:
    """metadata.resourceVersion of an object or a list, if any."""
    return (obj.get("metadata") or {}).get("resourceVersion") or None


def is_gone(exc: BaseException) -> bool:
    """A 410 Gone from the API server (an HTTP 410, or an ERROR watch event with code 410)."""
    return getattr(exc, "status", None) == HTTP_GONE


# -- Kubernetes -----------------------------------------------------------------------------------------


class _SliceState:
    """The EndpointSlices seen per selector; each change hands the merged endpoints to `publish`, in order."""

    def __init__(self, port_name: str, publish: OnChange) -> None:
        self.port_name = port_name
        self._publish = publish
        self._slices: dict[str, dict[str, EndpointSlice]] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    def replace(self, selector: str, items: Iterable[EndpointSlice]) -> None:
        """A fresh list for `selector`: slices not in it are gone."""
        with self._lock:
            self._slices[selector] = {slice_name(s): s for s in items}
            self._changed()

    def apply(self, selector: str, event_type: str, endpoint_slice: EndpointSlice) -> None:
        """One watch event (ADDED, MODIFIED or DELETED) for `selector`."""
        with self._lock:
            slices = self._slices.setdefault(selector, {})
            if event_type == "DELETED":
                slices.pop(slice_name(endpoint_slice), None)
            else:
                slices[slice_name(endpoint_slice)] = endpoint_slice
            self._changed()

    def _changed(self) -> None:
        everything = [s for slices in self._slices.values() for s in slices.values()]
        self._warn_portless(everything)
        self._publish(endpoints_from_slices(everything, self.port_name))

    def _warn_portless(self, slices: list[EndpointSlice]) -> None:
        for endpoint_slice in slices:
            name = slice_name(endpoint_slice)
            if slice_port(endpoint_slice, self.port_name) is None and name not in self._warned:
                self._warned.add(name)
                log.warning(
                    "endpointslice has no port with this name; skipped",
                    extra={"endpointslice": name, "port_name": self.port_name},
                )


class _SelectorWatcher:
    """Lists and watches one label selector in a daemon thread until stopped."""

    def __init__(
        self, api: Any, namespace: str, selector: str, state: _SliceState, watch_timeout_s: int
    ) -> None:
        from kubernetes import watch

        self.api = api
        self.namespace = namespace
        self.selector = selector
        self.state = state
        self.watch_timeout_s = watch_timeout_s
        self.version: str | None = None  # the last resourceVersion seen; None: list (again)
        self.watch = watch.Watch()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"k8s-watch {selector}", daemon=True)
        self._response: Any = None  # the open watch's HTTP response
        self._lock = threading.Lock()  # orders `stop` against a watch being opened

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Ask the thread to end; an open watch is unblocked by shutting its socket."""
        with self._lock:
            self.stopped.set()
            self.watch.stop()
            _shutdown(self._response)

    def _loop(self) -> None:
        failures = 0
        while not self.stopped.is_set():
            try:
                if self.version is None:
                    self._list()
                self._watch()
                failures = 0
            except Exception as exc:  # the thread must outlive any API, network or decoding error
                if self.stopped.is_set():
                    return
                if is_gone(exc) and self.version is not None:  # a list answering 410 backs off below
                    log.info("endpointslice watch expired; listing again", extra=self._extra())
                    self.version = None
                    continue
                failures += 1
                backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** (failures - 1))
                log.warning(
                    "endpointslice list/watch failed; retrying",
                    extra={**self._extra(), "reason": _describe(exc), "backoff_s": backoff},
                )
                self.stopped.wait(backoff)

    def _list(self) -> None:
        """List the selector's slices and replace what was known; the watch resumes from the list."""
        response = self.api.list_namespaced_endpoint_slice(
            self.namespace,
            label_selector=self.selector,
            _preload_content=False,
            _request_timeout=(CONNECT_TIMEOUT_S, CONNECT_TIMEOUT_S * 3),
        )
        try:
            body = json.loads(response.data)
        finally:
            response.release_conn()
        items = body.get("items") or []
        self.state.replace(self.selector, items)
        self.version = resource_version(body)
        log.info(
            "endpointslices listed",
            extra={**self._extra(), "slices": len(items), "resource_version": self.version},
        )

    def _open_watch(self, *args: Any, **kwargs: Any) -> Any:
        """Start the watch request for `Watch.stream`; one opened after `stop` is shut at once.

        Having no return type for `Watch.stream` to infer, it also spares building client models for the
        events (their `raw_object`, the API's JSON, is what is read either way).
        """
        response = self.api.list_namespaced_endpoint_slice(*args, **kwargs)
        with self._lock:
            self._response = response
            if self.stopped.is_set():
                _shutdown(response)
        return response

    def _watch(self) -> None:
        """Follow changes from `self.version` until the watch ends, keeping the last resourceVersion."""
        stream = self.watch.stream(
            self._open_watch,
            self.namespace,
            label_selector=self.selector,
            resource_version=self.version,
            allow_watch_bookmarks=True,
            timeout_seconds=self.watch_timeout_s,
            _request_timeout=(CONNECT_TIMEOUT_S, self.watch_timeout_s + CONNECT_TIMEOUT_S),
        )
        for event in stream:
            if self.stopped.is_set():
                break
            obj = event["raw_object"]
            if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                self.state.apply(self.selector, event["type"], obj)
            self.version = resource_version(obj) or self.version
        with self._lock:
            self._response = None

    def _extra(self) -> dict[str, str]:
        return {"namespace": self.namespace, "selector": self.selector}


class KubernetesDiscovery:
    """Replicas from the EndpointSlices matching any of `selectors` in `namespace` (see the module doc).

    `api_client` is a `kubernetes.client.ApiClient` (in-cluster or from a kubeconfig).
    """

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        selectors: Sequence[str],
        port_name: str = "grpc",
        watch_timeout_s: int = WATCH_TIMEOUT_S,
    ) -> None:
        from kubernetes import client

        self.api = client.DiscoveryV1Api(api_client)
        self.namespace = namespace
        self.selectors = list(selectors)
        self.port_name = port_name
        self.watch_timeout_s = watch_timeout_s

    async def run(self, on_change: OnChange) -> None:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[list[Endpoint]] = asyncio.Queue()

        def publish(endpoints: list[Endpoint]) -> None:  # called from the watcher threads
            loop.call_soon_threadsafe(updates.put_nowait, endpoints)

        state = _SliceState(self.port_name, publish)
        watchers = [
            _SelectorWatcher(self.api, self.namespace, s, state, self.watch_timeout_s) for s in self.selectors
        ]
        for watcher in watchers:
            watcher.start()
        try:
            await _deliver(updates, on_change)
        finally:
            for watcher in watchers:
                watcher.stop()


async def _deliver(updates: asyncio.Queue[list[Endpoint]], on_change: OnChange) -> None:
    """Hand each list that differs from the last one to `on_change`, forever."""
    last: list[Endpoint] | None = None
    while True:
        endpoints = await updates.get()
        if endpoints != last:
            on_change(endpoints)
            last = endpoints


def _shutdown(response: Any) -> None:
    """Shut the socket under an HTTP response, so a thread blocked reading it returns."""
    sock = getattr(getattr(response, "connection", None), "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _describe(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    return f"{type(exc).__name__} {status}" if status is not None else f"{type(exc).__name__}: {exc}"
