"""A stand-in Kubernetes API server for EndpointSlices, driven by tests, for the official client to list
and watch.

It serves `GET /apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices` with `labelSelector`
(`k=v`, `k!=v`, `k`, comma-separated): a list carries `metadata.resourceVersion`; `?watch=true&
resourceVersion=N` streams (chunked JSON lines) the events after N, then new ones, until `timeoutSeconds`.
Each change bumps the resourceVersion. Test controls: `put_slice` / `delete_slice` (with `silent=True` the
change reaches no watch, like events lost to compaction), `drop_watches` (the connection breaks mid
stream), `end_watches` (the streams end cleanly, as on a server timeout) and `expire_next_watch` (the next
watch is answered 410 Gone, as an HTTP 410 or as an ERROR event). `list_calls` and `watch_calls` record
the query of every request.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, urlparse

PATH_PREFIX = "/apis/discovery.k8s.io/v1/namespaces/"
PATH_SUFFIX = "/endpointslices"
POLL_S = 0.05

Expiry = Literal["http", "event"]


def slice_endpoint(
    address: str,
    pod: str,
    ready: bool | None = True,
    serving: bool | None = None,
    terminating: bool | None = None,
) -> dict[str, Any]:
    """One EndpointSlice endpoint; a condition left None is omitted, as the API may omit it."""
    conditions = {
        k: v
        for k, v in {"ready": ready, "serving": serving, "terminating": terminating}.items()
        if v is not None
    }
    return {
        "addresses": [address],
        "conditions": conditions,
        "targetRef": {"kind": "Pod", "name": pod, "namespace": "default"},
    }


def matches(selector: str, labels: Mapping[str, str]) -> bool:
    """Equality-based label selector: `k=v`, `k==v`, `k!=v` and `k` (exists), comma-separated."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class _Watcher:
    namespace: str
    selector: str
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)
    drop: bool = False  # break the connection mid stream
    end: bool = False  # end the stream cleanly


class K8sStandIn:
    """The API server's state (slices, resourceVersion, history) and its HTTP face, in a thread."""

    def __init__(self) -> None:
        self.slices: dict[tuple[str, str], dict[str, Any]] = {}
        self.version = 1
        self.history: list[tuple[int, str, dict[str, Any]]] = []
        self.list_calls: list[dict[str, str]] = []
        self.watch_calls: list[dict[str, str]] = []
        self.expire_next: Expiry | None = None
        self.failing_lists = 0  # answer this many next lists with a 500
        self._watchers: list[_Watcher] = []
        self._lock = threading.Condition()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._serve, name="k8s-stand-in", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def _serve(self) -> None:
        self._server.serve_forever(poll_interval=POLL_S)

    def start(self) -> K8sStandIn:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.end_watches()
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> K8sStandIn:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients --------------------------------------------------------------------------------------

    def api_client(self) -> Any:
        """A `kubernetes.client.ApiClient` pointed at this server."""
        from kubernetes import client

        return client.ApiClient(client.Configuration(host=self.url))

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig whose current context is this server (plain HTTP, a dummy token)."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "router", "user": {"token": "stand-in-token"}}],
            "contexts": [
                {
                    "name": "stand-in",
                    "context": {"cluster": "stand-in", "user": "router", "namespace": namespace},
                }
            ],
            "current-context": "stand-in",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path

    # -- test controls --------------------------------------------------------------------------------

    def put_slice(
        self,
        name: str,
        endpoints: list[dict[str, Any]],
        labels: Mapping[str, str],
        port: int | None = None,
        port_name: str = "grpc",
        namespace: str = "default",
        silent: bool = False,
    ) -> dict[str, Any]:
        """Create or replace a slice (ADDED or MODIFIED); `port` None takes each endpoint's own port.

        With `port` None every endpoint address must be HOST:PORT with one shared port.
        """
        if port is None:
            ports = {e["addresses"][0].rsplit(":", 1)[1] for e in endpoints}
            assert len(ports) <= 1, "a slice has one port for all its endpoints"
            port = int(ports.pop()) if ports else 0
            endpoints = [{**e, "addresses": [a.rsplit(":", 1)[0] for a in e["addresses"]]} for e in endpoints]
        obj = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
        }
        with self._lock:
            event = "MODIFIED" if (namespace, name) in self.slices else "ADDED"
            return self._record(event, obj, silent)

    def delete_slice(self, name: str, namespace: str = "default", silent: bool = False) -> None:
        with self._lock:
            obj = self.slices.pop((namespace, name))
            self._record("DELETED", obj, silent)

    def drop_watches(self) -> None:
        """Break every open watch connection without ending the chunked stream."""
        with self._lock:
            for watcher in self._watchers:
                watcher.drop = True

    def end_watches(self) -> None:
        """End every open watch stream cleanly, as the server does when timeoutSeconds runs out."""
        with self._lock:
            for watcher in self._watchers:
                watcher.end = True

    def expire_next_watch(self, how: Expiry = "event") -> None:
        """Answer the next watch request 410 Gone: an HTTP 410, or a 200 stream with one ERROR event."""
        with self._lock:
            self.expire_next = how

    def fail_next_lists(self, count: int) -> None:
        """Answer the next `count` list requests with a 500."""
        with self._lock:
            self.failing_lists = count

    def take_list_failure(self) -> bool:
        with self._lock:
            if self.failing_lists <= 0:
                return False
            self.failing_lists -= 1
            return True

    def open_watches(self) -> int:
        with self._lock:
            return len(self._watchers)

    def wait_until(self, predicate: Any, timeout: float = 5.0) -> None:
        """Wait until `predicate()` (checked under the server's lock) is true; AssertionError on timeout."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError("the stand-in API server did not reach the expected state")
                self._lock.wait(min(left, POLL_S))

    # -- server side ----------------------------------------------------------------------------------

    def _record(self, event: str, obj: dict[str, Any], silent: bool) -> dict[str, Any]:
        self.version += 1
        obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": str(self.version)}}
        if event != "DELETED":
            self.slices[(obj["metadata"]["namespace"], obj["metadata"]["name"])] = obj
        self.history.append((self.version, event, obj))
        if silent:
            return obj
        for watcher in self._watchers:
            if obj["metadata"]["namespace"] == watcher.namespace and matches(
                watcher.selector, obj["metadata"]["labels"]
            ):
                watcher.events.put({"type": event, "object": obj})
        self._lock.notify_all()
        return obj

    def list_body(self, namespace: str, selector: str) -> dict[str, Any]:
        with self._lock:
            items = [
                obj
                for (ns, _), obj in sorted(self.slices.items())
                if ns == namespace and matches(selector, obj["metadata"]["labels"])
            ]
            self._lock.notify_all()
            return {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSliceList",
                "metadata": {"resourceVersion": str(self.version)},
                "items": items,
            }

    def open_watch(self, namespace: str, selector: str, since: int) -> _Watcher | Expiry:
        """Register a watch and queue the events after `since`; or the 410 the test asked for."""
        with self._lock:
            if self.expire_next is not None:
                how, self.expire_next = self.expire_next, None
                self._lock.notify_all()
                return how
            watcher = _Watcher(namespace, selector)
            for version, event, obj in self.history:
                if (
                    version > since
                    and obj["metadata"]["namespace"] == namespace
                    and matches(selector, obj["metadata"]["labels"])
                ):
                    watcher.events.put({"type": event, "object": obj})
            self._watchers.append(watcher)
            self._lock.notify_all()
            return watcher

    def close_watch(self, watcher: _Watcher) -> None:
        with self._lock:
            self._watchers.remove(watcher)
            self._lock.notify_all()

    def watch_events(self, watcher: _Watcher, timeout_s: float) -> Iterator[dict[str, Any] | None]:
        """The watcher's events until it ends; None now and then so the caller can check for a drop."""
        deadline = time.monotonic() + timeout_s
        while not watcher.end and not watcher.drop and time.monotonic() < deadline:
            try:
                yield watcher.events.get(timeout=POLL_S)
            except queue.Empty:
                yield None


def gone_status(message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": "Expired",
        "code": 410,
    }


def _handler_for(server: K8sStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked watch streams, kept-alive list connections

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if not (url.path.startswith(PATH_PREFIX) and url.path.endswith(PATH_SUFFIX)):
                self._send_json(404, {"kind": "Status", "code": 404, "reason": "NotFound", "message": ""})
                return
            namespace = url.path[len(PATH_PREFIX) : -len(PATH_SUFFIX)]
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            selector = query.get("labelSelector", "")
            if query.get("watch") == "true":
                with server._lock:
                    server.watch_calls.append(query)
                self._watch(namespace, selector, query)
            else:
                with server._lock:
                    server.list_calls.append(query)
                if server.take_list_failure():
                    self._send_json(500, {"kind": "Status", "code": 500, "reason": "InternalError"})
                    return
                self._send_json(200, server.list_body(namespace, selector))

        def _send_json(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _watch(self, namespace: str, selector: str, query: Mapping[str, str]) -> None:
            since = int(query.get("resourceVersion") or server.version)
            opened = server.open_watch(namespace, selector, since)
            if opened == "http":
                self._send_json(410, gone_status(f"too old resource version: {since}"))
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            if opened == "event":
                self._chunk({"type": "ERROR", "object": gone_status(f"too old resource version: {since}")})
                self._end_stream()
                return
            assert not isinstance(opened, str)
            try:
                self._stream(opened, float(query.get("timeoutSeconds") or 1800))
            except OSError:  # the client went away
                self.close_connection = True
            finally:
                server.close_watch(opened)

        def _stream(self, watcher: _Watcher, timeout_s: float) -> None:
            for event in server.watch_events(watcher, timeout_s):
                if event is not None:
                    self._chunk(event)
                elif self._client_gone():
                    return
            if watcher.drop:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            self._end_stream()

        def _client_gone(self) -> bool:
            """The client closed its end (a watch client sends nothing after its request)."""
            readable, _, _ = select.select([self.connection], [], [], 0)
            if not readable:
                return False
            try:
                return self.connection.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                return True

        def _chunk(self, event: dict[str, Any]) -> None:
            data = (json.dumps(event) + "\n").encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

        def _end_stream(self) -> None:
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    return Handler
