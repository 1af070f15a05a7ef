"""The "torch" KV transport: chunk tensors cross over a torch.distributed pair group, not in gRPC messages.

The Prefill stream still carries the PrefillHeader and one KVChunk per chunk (index, positions, token
count, checksum) with empty `data`; each chunk's bytes travel as one send/recv on a two-rank process group
between the prefill replica P (rank 0, `TorchSender`) and the decode replica D (rank 1, `TorchReceiver`).

Rendezvous. D hosts one `TCPStore` (master, a free port, every interface) per process, created by its
first `prepare`. Before each Prefill call `TorchReceiver.prepare` writes the store's "host:port" into
`PrefillRequest.rendezvous` and a fresh `torch_tag` (a per-process counter). P connects to that store
(one client per D, cached) and, before its first chunk message, announces the transfer under
`kvrelay/kv/xfer/<tag>` (JSON): the pair group's name, the backend, a per-group sequence number and every
chunk's token count. D reads and deletes that key when the first chunk message arrives.

Whole transfers in flight. With the announcement D knows every chunk's size, so at the first chunk
message it posts the receives of all chunks at once, and P posts all its sends as soon as the group is
there; the bytes then stream at the backend's pace while the gRPC messages only tell D, chunk by chunk,
what to check and hand on (an earlier one-send-per-message design ran at half the gRPC transport's
rate on loopback, in lockstep with the messages). One daemon thread per transfer and side waits for the
ops in order (D: then computes each checksum) and settles one asyncio future per chunk.

Pair groups. One group per (P process, D process), built once through a `PrefixStore` keyed by the
group's name (P's process id plus a generation) and reused by every transfer between the two; each side
keeps at most `MAX_PEERS` (least recently used go first). Building is collective: on a new group P
yields the first chunk message before it builds (D builds when that message arrives), so neither waits
on the other's gRPC progress. Building uses a store client of its own, since it waits in the store until
the peer joins and would hold a shared client's other calls behind it.

Backends. "gloo" when the KV lives in host memory; "nccl" when it is on CUDA (P: the export's device;
D: `TorchReceiver(device=...)`; both must agree or D refuses the transfer). Gloo matches send/recv by
tag, so concurrent transfers on one pair run side by side, one tag each (tested, and measured with
threads posting interleaved tags in opposite orders). NCCL ignores tags and matches by issue order, so
on an NCCL pair P holds the pair for a whole transfer and D posts each transfer's receives in the
announced sequence order. NCCL cannot run on this project's CPU machines: that path is written to be
read; a transfer D abandons before its first chunk then stalls the pair's next one until its deadline,
which resets the pair.

Threads, not the event loop. Every blocking call (store I/O, building a group, posting ops, waiting for
them, checksums) runs on short-lived daemon threads whose results come back as asyncio futures: a wait may
last until the transfer deadline, so it must neither hold the loop nor occupy the loop's default
executor, nor hold up interpreter exit. Every wait is bounded: P by `timeout_s` from its first chunk, D
by `timeout_s` from `prepare` (the Prefill call's deadline is the same budget). A cancelled transfer
leaves its waiting thread to finish; that thread keeps the buffers alive, since gloo must never see a
posted buffer freed (it would write into freed memory or wedge the pair).

Integrity. P checksums each chunk's bytes where they are and names the checksum in its announcement:
in host memory (gloo) zlib's CRC-32 into `KVChunk.crc32`, the same value the gRPC transport sends; on a GPU
(NCCL) device_checksum.py's Fletcher pair into `KVChunk.device_checksum`, computed on the device, so no
chunk is copied to the host only to be checked, when D lists "device" in `PrefillRequest.kv_checksums`
(its `prepare` does; a D from before device checksums lists nothing and gets CRC-32). P refuses a tensor
whose size is not `num_tokens * bytes_per_token`. D receives into exactly the announced bytes, refuses a
chunk message that disagrees with the announcement, and checks the announced checksum on its own copy (on
its device for "device"), raising `KVTransferFault` on a mismatch. An announcement without a checksum (a
P from before device checksums) means CRC-32, so such a P still works: either pool can be upgraded first.
Gloo cannot report how many bytes arrived: a shorter message leaves the buffer's tail unwritten (the
checksum then fails), and a longer one aborts the receiving process inside gloo, which is why sizes are
enforced on the sending side before anything is posted.

Failure. A gloo/NCCL error, a timeout, a dead peer or a refused announcement raises `KVTransferFault` on D
(which then recomputes locally) and ends P's stream with an error. A failed or timed-out op closes its
pair group (a gloo wait that times out closes every connection of its group by itself): the group is
aborted, D marks it dead in its store (P checks before each transfer) or P names it as replaced in its
next announcement, and both sides build a new one; concurrent transfers on that pair fail over too.

Trust. D's store listens unauthenticated on every interface and gloo/NCCL carry raw bytes: like any
torch.distributed job, this transport assumes a private network between the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import itertools
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from services.engine.kv_export import KVExport
from services.kvtransfer.chunks import TARGET_CHUNK_BYTES, KVTransferFault, Layout, split, tokens_per_chunk
from services.kvtransfer.device_checksum import ChecksumKind, checksum_kind, kv_checksum
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb

if not dist.is_available():  # services/worker/server.py then offers "grpc" only
    raise ImportError("this torch build has no torch.distributed")

log = logging.getLogger(__name__)

SENDER_RANK = 0
RECEIVER_RANK = 1
DEFAULT_TIMEOUT_S = 30.0
MAX_PEERS = 64  # pair groups (D) or peer links (P) kept per process
MAX_RETIRED = 4096  # closed group names D remembers, so that it never builds one again
MARKER_TIMEOUT_S = 5.0
KEY_PREFIX = "kvrelay/kv"

T = TypeVar("T")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _xfer_key(tag: int) -> str:
    return f"{KEY_PREFIX}/xfer/{tag}"


def _dead_key(name: str) -> str:
    return f"{KEY_PREFIX}/dead/{name}"


def _timedelta(deadline: float) -> datetime.timedelta:
    remaining = deadline - time.monotonic()
    if remaining <= 0.001:
        raise KVTransferFault("the KV transfer deadline passed")
    return datetime.timedelta(seconds=remaining)


def _fault(what: str, exc: BaseException) -> KVTransferFault:
    first_line = str(exc).splitlines()[0] if str(exc) else ""
    return KVTransferFault(f"{what}: {type(exc).__name__}: {first_line}")


# ------------------------------------------------------------------------------ blocking calls, off the loop


def _in_thread(fn: Callable[[], T]) -> asyncio.Future[T]:
    """`fn()` on its own daemon thread; its result or exception comes back as a future of this loop."""
    return _each_in_thread(lambda _: fn(), 1)[0]


def _each_in_thread(fn: Callable[[int], T], count: int) -> list[asyncio.Future[T]]:
    """`fn(0)`, `fn(1)`, ... in order on one daemon thread, one future each, settled as each returns. After
    an exception the rest are not run and their futures get that exception. A future nobody awaits any
    more (its transfer was cancelled) is settled all the same and dropped; every `fn` here is bounded."""
    loop = asyncio.get_running_loop()
    futures: list[asyncio.Future[T]] = [loop.create_future() for _ in range(count)]
    for future in futures:
        future.add_done_callback(_retrieve)

    def settle(future: asyncio.Future[T], result: Any, exc: BaseException | None) -> None:
        if future.done():
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    def run() -> None:
        for index, future in enumerate(futures):
            try:
                result = fn(index)
            except BaseException as exc:
                for failed in futures[index:]:
                    _call_soon(loop, settle, failed, None, exc)
                return
            _call_soon(loop, settle, future, result, None)

    threading.Thread(target=run, name="kvrelay-kv-torch", daemon=True).start()
    return futures


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:
    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody is waiting
        loop.call_soon_threadsafe(fn, *args)


def _retrieve(future: asyncio.Future[Any]) -> None:
    """Mark an abandoned future's exception as seen (its transfer already failed over)."""
    if not future.cancelled():
        future.exception()


# ------------------------------------------------------------------------------ shared by both sides


@dataclass(frozen=True)
class _Announcement:
    """What P tells D about one transfer, through D's store, before the first chunk message."""

    group: str
    backend: str
    seq: int
    tokens: tuple[int, ...]  # each chunk's token count, in order
    replaces: str = ""  # P's previous group with this D, now closed
    checksum: ChecksumKind = ChecksumKind.CRC32  # what the chunk messages carry (see Integrity)

    def encode(self) -> str:
        return json.dumps({**self.__dict__, "tokens": list(self.tokens), "checksum": str(self.checksum)})

    @classmethod
    def decode(cls, raw: bytes) -> _Announcement:
        try:
            fields = json.loads(raw)
            return cls(
                str(fields["group"]),
                str(fields["backend"]),
                int(fields["seq"]),
                tuple(int(n) for n in fields["tokens"]),
                str(fields.get("replaces", "")),
                ChecksumKind(fields.get("checksum", ChecksumKind.CRC32)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise KVTransferFault(f"unreadable torch transfer announcement {raw[:200]!r}") from exc


class _PairGroup:
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
                    store = _connect(self._rendezvous, deadline)  # a client of its own, see above
                    prefixed = dist.PrefixStore(f"{KEY_PREFIX}/pair/{self.name}", store)
                    pg = _build(self.backend, prefixed, self.rank, _timedelta(deadline))
                except Exception as exc:
                    self._dead = True
                    raise _fault(f"building pair group {self.name}", exc) from exc
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
            raise _fault(f"{op} on {self.name}", exc) from exc

    def wait(self, work: Any, deadline: float, what: str) -> None:
        """Wait for one posted op; a failure or timeout closes the group (its other ops cannot be trusted
        either, and a gloo timeout has already closed its connections)."""
        try:
            work.wait(_timedelta(deadline))
        except Exception as exc:
            self.close(f"{what} failed")
            raise _fault(f"{what} on {self.name}", exc) from exc

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


def _post_and_wait(
    group: _PairGroup,
    op: str,
    flats: list[torch.Tensor],
    tag: int,
    seq: int,
    deadline: float,
    then: Callable[[int], T],
) -> list[asyncio.Future[T]]:
    """Post one `op` per buffer, then wait for each in order, all on one daemon thread: that thread holds
    the posted ops and their buffers until they completed or the group was closed, whatever becomes of
    the coroutine that awaits them. Future i settles with `then(i)` once op i completed."""
    works: list[Any] = []

    def step(index: int) -> T:
        if index == 0:
            works.extend(group.post(op, flats, tag, seq, deadline))
        group.wait(works[index], deadline, f"{op} of chunk {index}")
        return then(index)

    return _each_in_thread(step, len(flats))


def _mark_dead(rendezvous: str, name: str, reason: str) -> None:
    """Through a store client of its own, never the receiver's master store: a master released on a
    daemon thread while the process exits aborts the process (observed)."""
    with contextlib.suppress(Exception):
        _connect(rendezvous, time.monotonic() + MARKER_TIMEOUT_S).set(_dead_key(name), reason)


def _seconds(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())


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


def _connect(rendezvous: str, deadline: float) -> Any:
    host, sep, port = rendezvous.rpartition(":")
    if not sep or not port.isdigit():
        raise KVTransferFault(f"bad rendezvous {rendezvous!r}; expected host:port")
    try:
        return dist.TCPStore(host.strip("[]"), int(port), None, False, _timedelta(deadline))
    except KVTransferFault:
        raise
    except Exception as exc:
        raise _fault(f"connecting to the store at {rendezvous}", exc) from exc


# ------------------------------------------------------------------------------ P side


@dataclass
class _Link:
    """P's connection to one D: a client of D's store and the current pair group."""

    store: Any
    group: _PairGroup | None = None


def _agreed_checksum(request: kvpb.PrefillRequest, device: torch.device) -> ChecksumKind:
    """The checksum for KV on `device` (`checksum_kind`) when D verifies it, else CRC-32: a D from before
    device checksums lists none, and gets what it checks (from a GPU, through a host copy)."""
    kind = checksum_kind(device)
    return kind if kind == ChecksumKind.CRC32 or kind in request.kv_checksums else ChecksumKind.CRC32


class TorchSender:
    """Prefill side: announces each transfer in D's store and sends every chunk's tensor to rank 1."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, checksum: ChecksumKind | None = None) -> None:
        """`checksum`: what every chunk gets; None picks by the export's device (`checksum_kind`)."""
        self.timeout_s = timeout_s
        self.checksum = checksum
        self._id = uuid.uuid4().hex[:12]
        self._generations = itertools.count(1)
        self._links: OrderedDict[str, _Link] = OrderedDict()
        self._lock = threading.Lock()

    def chunk_bytes(self, request: kvpb.PrefillRequest) -> int:
        return TARGET_CHUNK_BYTES

    async def chunks(
        self, request: kvpb.PrefillRequest, export: KVExport, layout: Layout
    ) -> AsyncGenerator[kvpb.KVChunk, None]:
        pieces = list(split(export, layout))
        for piece in pieces:
            _check_piece(piece.kv, layout)
        if not pieces:
            return
        if not request.rendezvous:
            raise KVTransferFault("the torch transport needs PrefillRequest.rendezvous")
        deadline = time.monotonic() + self.timeout_s
        backend = backend_for(export.kv.device)
        kind = self.checksum or _agreed_checksum(request, export.kv.device)
        rendezvous, tag = request.rendezvous, request.torch_tag
        flats = [piece.kv.contiguous().view(torch.uint8).reshape(-1) for piece in pieces]
        link, group, replaced = await _in_thread(lambda: self._open(rendezvous, backend, deadline))
        lock = group.transfer_lock if group.ordered else contextlib.nullcontext()
        async with lock:
            tokens = tuple(piece.kv.shape[1] for piece in pieces)
            announcement = _Announcement(group.name, backend, group.next_seq(), tokens, replaced, kind)
            await _in_thread(lambda: self._announce(link, group, tag, announcement))
            sums = _each_in_thread(lambda i: kv_checksum(flats[i], kind), len(flats))
            sent: list[asyncio.Future[None]] = []
            finished = False
            try:
                if group.ready:  # start sending before the first message: D posts on that message
                    sent = self._send_all(group, flats, tag, announcement.seq, deadline)
                for index, piece in enumerate(pieces):
                    chunk = kvpb.KVChunk(index=index, start_token=piece.start_token, num_tokens=tokens[index])
                    if kind == ChecksumKind.DEVICE:
                        chunk.device_checksum = await sums[index]
                    else:
                        chunk.crc32 = await sums[index]
                    yield chunk
                    if not sent:  # a new group: D builds its side on this first message
                        sent = self._send_all(group, flats, tag, announcement.seq, deadline)
                await sent[-1]  # in order: the last one settles after every other
                finished = True
            finally:
                if group.ordered and not finished:  # the next transfer would post behind ours: reset
                    group.close("transfer ended early")

    def _send_all(
        self, group: _PairGroup, flats: list[torch.Tensor], tag: int, seq: int, deadline: float
    ) -> list[asyncio.Future[None]]:
        return _post_and_wait(group, "send", flats, tag, seq, deadline, lambda _: None)

    def _open(self, rendezvous: str, backend: str, deadline: float) -> tuple[_Link, _PairGroup, str]:
        """The link to this D and its current usable group (a new one if the last one was closed)."""
        with self._lock:
            link = self._links.get(rendezvous)
            if link is not None:
                self._links.move_to_end(rendezvous)
        if link is None:
            link = _Link(_connect(rendezvous, deadline))
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
                raise _fault(f"reaching the store at {rendezvous}", exc) from exc
            if not closed_by_peer:
                return link, group, ""
        replaced = ""
        if group is not None:
            group.close("replaced")
            replaced = group.name
        with self._lock:
            if link.group is group:
                name = f"{self._id}-{next(self._generations)}"
                link.group = _PairGroup(name, backend, rendezvous, SENDER_RANK, self.timeout_s)
            fresh = link.group
        assert fresh is not None
        return link, fresh, replaced

    def _announce(self, link: _Link, group: _PairGroup, tag: int, announcement: _Announcement) -> None:
        try:
            link.store.set(_xfer_key(tag), announcement.encode())
        except Exception as exc:
            group.close("store unreachable")
            raise _fault("announcing the transfer", exc) from exc

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


def _check_piece(kv: torch.Tensor, layout: Layout) -> None:
    """Refuse a tensor whose bytes would not be exactly what D expects (gloo would abort D on more)."""
    expected = (layout.num_layers, kv.shape[1], 2, layout.num_kv_heads, layout.head_dim)
    if tuple(kv.shape) != expected or kv.dtype != layout.dtype:
        raise KVTransferFault(f"KV piece {tuple(kv.shape)} {kv.dtype} does not match the layout {expected}")


# ------------------------------------------------------------------------------ D side


@dataclass
class _Inbound:
    """D's state for one prepared transfer, from `prepare` to its last chunk (or its deadline)."""

    deadline: float
    announcement: _Announcement | None = None
    group: _PairGroup | None = None
    flats: list[torch.Tensor] = field(default_factory=list)
    arrivals: list[asyncio.Future[int]] = field(default_factory=list)  # each chunk's checksum, once landed


class TorchReceiver:
    """Decode side: hosts the rendezvous store, and receives every chunk's tensor from rank 0."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        host: str | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        self.timeout_s = timeout_s
        self.host = host or _advertised_host()
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self._store: Any = None
        self._rendezvous = ""
        self._tags = itertools.count(1)
        self._inbound: dict[int, _Inbound] = {}
        self._groups: OrderedDict[str, _PairGroup] = OrderedDict()
        self._retired: OrderedDict[str, None] = OrderedDict()  # closed group names, newest last
        self._lock = threading.Lock()

    @property
    def rendezvous(self) -> str:
        return self._rendezvous

    def prepare(self, request: kvpb.PrefillRequest) -> None:
        now = time.monotonic()
        if self._store is None:  # once per process: binding a port takes a moment, on this thread
            try:
                timeout = datetime.timedelta(seconds=self.timeout_s)
                self._store = dist.TCPStore(self.host, 0, None, True, timeout, wait_for_workers=False)
            except Exception as exc:
                raise _fault("starting the KV rendezvous store", exc) from exc
            host = f"[{self.host}]" if ":" in self.host else self.host
            self._rendezvous = f"{host}:{self._store.port}"
        for tag in [t for t, inbound in self._inbound.items() if inbound.deadline < now]:
            del self._inbound[tag]  # abandoned (the caller went away or failed over)
        tag = next(self._tags) & 0xFFFFFFFF
        self._inbound[tag] = _Inbound(deadline=now + self.timeout_s)
        request.rendezvous = self._rendezvous
        request.torch_tag = tag
        request.kv_checksums[:] = [ChecksumKind.DEVICE]  # besides CRC-32, which every D verifies

    async def receive(
        self, request: kvpb.PrefillRequest, chunk: kvpb.KVChunk, layout: Layout
    ) -> torch.Tensor:
        tag = request.torch_tag
        inbound = self._inbound.get(tag)
        if inbound is None or request.rendezvous != self._rendezvous:
            raise KVTransferFault(f"torch transfer {tag} was not prepared here (or it expired)")
        try:
            if inbound.announcement is None:
                if chunk.index != 0:
                    raise KVTransferFault(f"torch transfer {tag} starts at chunk {chunk.index}")
                await self._start(tag, inbound, layout)
            announcement = inbound.announcement
            assert announcement is not None
            tokens = announcement.tokens
            if chunk.index >= len(tokens) or chunk.num_tokens != tokens[chunk.index]:
                raise KVTransferFault(f"chunk {chunk.index} ({chunk.num_tokens} tokens) was not announced")
            sent = chunk.device_checksum if announcement.checksum == ChecksumKind.DEVICE else chunk.crc32
            if await inbound.arrivals[chunk.index] != sent:
                raise KVTransferFault(f"chunk {chunk.index}: checksum mismatch")
        except BaseException as exc:
            self._inbound.pop(tag, None)
            group = inbound.group
            if isinstance(exc, KVTransferFault) and group is not None and group.dead:
                await _in_thread(group.told)
            raise
        if chunk.index + 1 == len(tokens):
            self._inbound.pop(tag, None)
        shape = (layout.num_layers, chunk.num_tokens, 2, layout.num_kv_heads, layout.head_dim)
        return inbound.flats[chunk.index].view(layout.dtype).view(shape)

    def release(self, request: kvpb.PrefillRequest) -> None:
        """Nothing to do: a transfer's state goes at its last chunk or its failure, and an abandoned one
        expires at its deadline (its waiting threads must keep the posted buffers until then)."""

    async def _start(self, tag: int, inbound: _Inbound, layout: Layout) -> None:
        """Read the announcement, and post the receives of every chunk it promises."""
        deadline = inbound.deadline
        announcement = await _in_thread(lambda: self._read_announcement(tag, deadline))
        group = inbound.group = self._group_for(announcement)
        step = tokens_per_chunk(layout)
        if not all(0 < n <= step for n in announcement.tokens):
            raise KVTransferFault(f"announced chunks of {announcement.tokens} tokens; at most {step} fit")
        flats = [
            torch.empty(n * layout.bytes_per_token, dtype=torch.uint8, device=self.device)
            for n in announcement.tokens
        ]
        kind = announcement.checksum
        inbound.arrivals = _post_and_wait(
            group, "recv", flats, tag, announcement.seq, deadline, lambda i: kv_checksum(flats[i], kind)
        )
        inbound.flats = flats
        inbound.announcement = announcement

    def _read_announcement(self, tag: int, deadline: float) -> _Announcement:
        key = _xfer_key(tag)
        try:
            self._store.wait([key], _timedelta(deadline))
            raw = self._store.get(key)
            self._store.delete_key(key)
        except KVTransferFault:
            raise
        except Exception as exc:
            raise _fault(f"reading the announcement of transfer {tag}", exc) from exc
        return _Announcement.decode(raw)

    def _group_for(self, announcement: _Announcement) -> _PairGroup:
        if announcement.backend != self.backend:
            raise KVTransferFault(
                f"the prefill replica sends over {announcement.backend}; KV here is on {self.device} "
                f"({self.backend})"
            )
        with self._lock:
            if announcement.replaces:
                self._retire(announcement.replaces, "replaced by the sender")
            if announcement.group in self._retired:
                raise KVTransferFault(f"pair group {announcement.group} is closed")
            group = self._groups.get(announcement.group)
            if group is not None and group.dead:
                self._retire(group.name, "closed")
                raise KVTransferFault(f"pair group {announcement.group} is closed")
            if group is None:
                group = _PairGroup(
                    announcement.group, self.backend, self._rendezvous, RECEIVER_RANK, self.timeout_s
                )
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
        """Abort every pair group and release the store (call once transfers are over)."""
        with self._lock:
            groups = list(self._groups.values())
            self._groups.clear()
        for group in groups:
            group.close("receiver closed", tell_peer=False)
        self._inbound.clear()
        self._store = None
        self._rendezvous = ""


def _advertised_host() -> str:
    """The address peers reach this host at: what its hostname resolves to (the pod IP under
    Kubernetes), else loopback. Gloo picks its own interface the usual way (GLOO_SOCKET_IFNAME, else
    the hostname's address)."""
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"
