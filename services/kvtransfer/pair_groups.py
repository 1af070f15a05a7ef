"""The torch KV transport's pair groups: the two-rank torch.distributed process groups between a prefill
replica P (rank 0) and a decode replica D (rank 1), the rendezvous store they meet through, and the
caches each side keeps them in. The transfers over them are torch_transport.py's.

Rendezvous. D hosts one `TCPStore` (master, a free port, every interface) per process (`host_store`),
reached as "host:port" at the address its hostname resolves to (`advertised_host`). P connects to it
(`connect_store`), one client per D, cached in that D's `Link`.

Pair groups. One group per (P process, D process), built once through a `PrefixStore` keyed by the
group's name (P's process id plus a generation) and reused by every transfer between the two; each side
keeps at most `MAX_PEERS` (least recently used go first): P in `SenderLinks`, D in `ReceiverGroups`,
which also remembers the last `MAX_RETIRED` closed names so that it never builds one of them again.
Building is collective (`PairGroup.get` blocks until the peer joins); it uses a store client of its own,
since it waits in the store until the peer joins and would hold a shared client's other calls behind it.

Backends. "gloo" when the KV lives in host memory; "nccl" when it is on CUDA (`backend_for`). Gloo
matches send/recv by tag; NCCL ignores tags and matches by issue order, so on an NCCL pair
(`PairGroup.ordered`) P holds `transfer_lock` for a whole transfer and D posts each transfer's receives
in its announced sequence order (`PairGroup.post`). An NCCL group aborts its communicator and raises in
the waiting call on an error or timeout, instead of ending the whole worker process.

Closing. A failed or timed-out op closes its pair group (a gloo wait that times out closes every
connection of its group by itself): the group is aborted, D marks it dead in its store through a client
of its own (P checks before each transfer, in `SenderLinks.open`) or P names it as replaced in its next
announcement, and both sides build a new one; concurrent transfers on that pair fail over too.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.kvtransfer.chunks import KVTransferFault

if not dist.is_available():  # services/worker/server.py then offers "grpc" only
    raise ImportError("this torch build has no torch.distributed")

log = logging.getLogger(__name__)

SENDER_RANK = 0
RECEIVER_RANK = 1
MAX_PEERS = 64  # pair groups (D) or peer links (P) kept per process
MAX_RETIRED = 4096  # closed group names D remembers, so that it never builds one again
MARKER_TIMEOUT_S = 5.0
KEY_PREFIX = "kvrelay/kv"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _dead_key(name: str) -> str:
    return f"{KEY_PREFIX}/dead/{name}"


def timedelta_until(deadline: float) -> datetime.timedelta:
    remaining = deadline - time.monotonic()
    if remaining <= 0.001:
        raise KVTransferFault("the KV transfer deadline passed")
    return datetime.timedelta(seconds=remaining)


def _seconds(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


def fault(what: str, exc: BaseException) -> KVTransferFault:
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return KVTransferFault(f"{what}: {type(exc).__name__}: {first_line}")


# ------------------------------------------------------------------------------ one pair group


class PairGroup:
    """One side of the two-rank group between one P and one D, built on first use and then shared."""

    def __init__(self, name: str, backend: str, rendezvous: str, rank: int, timeout_s: float) -> None:
        self.name = name
        self.backend = backend
        self.rank = rank
        self.ordered = backend == "nccl"  # NCCL matches by issue order, not by tag
        self.transfer_lock = asyncio.Lock()  # P, ordered backends: one transfer at a time on this pair
        self._rendezvous = rendezvous
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._pg: Any = None
        self._dead = False
        self._seqs = itertools.count()
        self._turn = threading.Condition()
        self._turn_seq = 0  # D, ordered backends: the transfer whose receives may be posted now
        self._marker: threading.Thread | None = None  # D: writes the dead marker P reads, once closed

    @property
    def dead(self) -> bool:
        return self._dead

    @property
    def ready(self) -> bool:
        return self._pg is not None and not self._dead

    def next_seq(self) -> int:
        return next(self._seqs)

    def get(self, deadline: float) -> Any:
        """The process group, built now if this is its first use (blocks until the peer joins)."""
        with self._lock:
            if self._dead:
                raise KVTransferFault(f"pair group {self.name} is closed")
            if self._pg is None:
                deadline = min(deadline, time.monotonic() + self._timeout_s)
                try:
                    store = connect_store(self._rendezvous, deadline)  # a client of its own, see above
                    prefixed = dist.PrefixStore(f"{KEY_PREFIX}/pair/{self.name}", store)
                    pg = _build(self.backend, prefixed, self.rank, timedelta_until(deadline))
                except Exception as exc:
                    self._dead = True
                    raise fault(f"building pair group {self.name}", exc) from exc
                if self._dead:  # closed while it was being built
                    with contextlib.suppress(Exception):
                        pg.abort()
                    raise KVTransferFault(f"pair group {self.name} is closed")
                self._pg = pg
                log.info("kv pair group ready", extra={"group": self.name, "backend": self.backend})
            return self._pg

    def post(self, op: str, flats: Sequence[torch.Tensor], tag: int, seq: int, deadline: float) -> list[Any]:
        """Post one send or recv per buffer, in order. On an ordered backend D posts a transfer's receives
        only once every earlier transfer on the pair posted its own (P's `transfer_lock` orders sends)."""
        pg = self.get(deadline)
        if not self.ordered or op == "send":
            return self._post_all(pg, op, flats, tag)
        with self._turn:
            if not self._turn.wait_for(lambda: self._turn_seq == seq or self._dead, _seconds(deadline)):
                self.close(f"transfer {seq} waited too long for its turn")
                raise KVTransferFault(f"transfer {seq} on {self.name} waited too long for its turn")
            works = self._post_all(pg, op, flats, tag)
            self._turn_seq = seq + 1
            self._turn.notify_all()
            return works

    def _post_all(self, pg: Any, op: str, flats: Sequence[torch.Tensor], tag: int) -> list[Any]:
        if self._dead:
            raise KVTransferFault(f"pair group {self.name} is closed")
        try:
            if op == "send":
                return [pg.send([flat], RECEIVER_RANK, tag) for flat in flats]
            return [pg.recv([flat], SENDER_RANK, tag) for flat in flats]
        except Exception as exc:  # ops already posted may stay unmatched: the group cannot be trusted
            self.close(f"{op} failed")
            raise fault(f"{op} on {self.name}", exc) from exc

    def wait(self, work: Any, deadline: float, what: str) -> None:
        """Wait for one posted op; a failure or timeout closes the group (its other ops cannot be trusted
        either, and a gloo timeout has already closed its connections)."""
        try:
            work.wait(timedelta_until(deadline))
        except Exception as exc:
            self.close(f"{what} failed")
            raise fault(f"{what} on {self.name}", exc) from exc

    def close(self, reason: str, tell_peer: bool = True) -> None:
        """Abort the group and (D) mark it dead for P; idempotent, never blocks on the group's lock."""
        if self._dead and self._pg is None:
            return
        self._dead = True
        with self._turn:
            self._turn.notify_all()
        log.warning("kv pair group closed", extra={"group": self.name, "reason": reason})
        if tell_peer and self.rank == RECEIVER_RANK:  # so that P's next transfer builds a new group
            marker = functools.partial(_mark_dead, self._rendezvous, self.name, reason)
            self._marker = threading.Thread(target=marker, name="kvrelay-kv-torch", daemon=True)
            self._marker.start()
        pg, self._pg = self._pg, None
        if pg is not None:
            with contextlib.suppress(Exception):
                pg.abort()

    def told(self) -> None:
        """D: block until the dead marker is written (or gave up), so that a transfer's fault reaches
        its caller only after P can see it: P's next transfer then builds a new group, not the old one."""
        marker = self._marker
        if marker is not None:
            marker.join(MARKER_TIMEOUT_S)


def _mark_dead(rendezvous: str, name: str, reason: str) -> None:
    """Through a store client of its own, never the receiver's master store: a master released on a
    daemon thread while the process exits aborts the process (observed)."""
    with contextlib.suppress(Exception):
        connect_store(rendezvous, time.monotonic() + MARKER_TIMEOUT_S).set(_dead_key(name), reason)


def _build(backend: str, store: Any, rank: int, timeout: datetime.timedelta) -> Any:
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timeout)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if backend != "nccl" or nccl is None:
        raise KVTransferFault(f"backend {backend!r} is not available in this torch build")
    # On an error or timeout, abort the communicator and raise in the waiting call; the default (3)
    # would end the whole worker process instead of one transfer.
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    options = nccl.Options()
    options._timeout = timeout
    return nccl(store, rank, 2, options)  # NCCL: Work.wait(timeout) blocks this thread, bounded


# ------------------------------------------------------------------------------ the rendezvous store


def host_store(host: str, timeout_s: float) -> tuple[Any, str]:
    """D: the master store on a free port of every interface, and its "host:port" for P."""
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
    except Exception as exc:
        raise fault("starting the KV rendezvous store", exc) from exc
    bracketed = f"[{host}]" if ":" in host else host
    return store, f"{bracketed}:{store.port}"


def connect_store(rendezvous: str, deadline: float) -> Any:
    host, sep, port = rendezvous.rpartition(":")
    if not sep or not port.isdigit():
        raise KVTransferFault(f"bad rendezvous {rendezvous!r}; expected host:port")
    try:
        return dist.TCPStore(host.strip("[]"), int(port), None, False, timedelta_until(deadline))
    except KVTransferFault:
        raise
    except Exception as exc:
        raise fault(f"connecting to the store at {rendezvous}", exc) from exc


def advertised_host() -> str:
    """The address peers reach this host at: what its hostname resolves to (the pod IP under
    Kubernetes), else loopback. Gloo picks its own interface the usual way (GLOO_SOCKET_IFNAME, else
    the hostname's address)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


# ------------------------------------------------------------------------------ P side


@dataclass
class Link:
    """P's connection to one D: a client of D's store and the current pair group."""

    store: Any
    group: PairGroup | None = None


class SenderLinks:
    """P's links, one per D (by rendezvous), at most `MAX_PEERS`; each holds P's current group with it."""

    def __init__(self) -> None:
        self._id = uuid.uuid4().hex[:12]
        self._generations = itertools.count(1)
        self._links: OrderedDict[str, Link] = OrderedDict()
        self._lock = threading.Lock()

    def open(
        self, rendezvous: str, backend: str, deadline: float, timeout_s: float
    ) -> tuple[Link, PairGroup, str]:
        """The link to this D, its current usable group (a new one if the last one was closed) and the
        name of the group that one replaces ("" if none)."""
        with self._lock:
            link = self._links.get(rendezvous)
            if link is not None:
                self._links.move_to_end(rendezvous)
        if link is None:
            link = Link(connect_store(rendezvous, deadline))
            with self._lock:
                link = self._links.setdefault(rendezvous, link)
                self._evict_over_cap()
        with self._lock:
            group = link.group
        if group is not None and not group.dead and group.backend == backend:
            try:
                closed_by_peer = link.store.check([_dead_key(group.name)])
            except Exception as exc:
                self._forget(rendezvous)
                raise fault(f"reaching the store at {rendezvous}", exc) from exc
            if not closed_by_peer:
                return link, group, ""
        replaced = ""
        if group is not None:
            group.close("replaced")
            replaced = group.name
        with self._lock:
            if link.group is group:
                name = f"{self._id}-{next(self._generations)}"
                link.group = PairGroup(name, backend, rendezvous, SENDER_RANK, timeout_s)
            fresh = link.group
        assert fresh is not None
        return link, fresh, replaced

    def _forget(self, rendezvous: str) -> None:
        with self._lock:
            link = self._links.pop(rendezvous, None)
        if link is not None and link.group is not None:
            link.group.close("forgotten")

    def _evict_over_cap(self) -> None:
        while len(self._links) > MAX_PEERS:
            _, link = self._links.popitem(last=False)
            if link.group is not None:
                link.group.close("least recently used")

    def close(self) -> None:
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            if link.group is not None:
                link.group.close("sender closed")


# ------------------------------------------------------------------------------ D side


class ReceiverGroups:
    """D's pair groups by name, at most `MAX_PEERS`, and the names of closed ones (never built again)."""

    def __init__(self) -> None:
        self._groups: OrderedDict[str, PairGroup] = OrderedDict()
        self._retired: OrderedDict[str, None] = OrderedDict()  # closed group names, newest last
        self._lock = threading.Lock()

    def get(self, name: str, replaces: str, backend: str, rendezvous: str, timeout_s: float) -> PairGroup:
        """The group `name` a transfer was announced on (new if unknown), after retiring `replaces`."""
        with self._lock:
            if replaces:
                self._retire(replaces, "replaced by the sender")
            if name in self._retired:
                raise KVTransferFault(f"pair group {name} is closed")
            group = self._groups.get(name)
            if group is not None and group.dead:
                self._retire(group.name, "closed")
                raise KVTransferFault(f"pair group {name} is closed")
            if group is None:
                group = PairGroup(name, backend, rendezvous, RECEIVER_RANK, timeout_s)
                self._groups[group.name] = group
                while len(self._groups) > MAX_PEERS:
                    self._retire(next(iter(self._groups)), "least recently used")
            self._groups.move_to_end(group.name)
            return group

    def _retire(self, name: str, reason: str) -> None:
        """Drop a group for good (the caller holds `_lock`): its name is never built again here."""
        self._retired[name] = None
        while len(self._retired) > MAX_RETIRED:
            self._retired.popitem(last=False)
        group = self._groups.pop(name, None)
        if group is not None:
            group.close(reason)

    def close(self) -> None:
        """Abort every pair group, without marking them dead for P (the store goes too)."""
        with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
        for group in groups:
            group.close("receiver closed", tell_peer=False)
