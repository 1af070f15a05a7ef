"""The "torch" KV transport: chunk tensors cross over a torch.distributed pair group, not in gRPC messages.

The Prefill stream still carries the PrefillHeader and one KVChunk per chunk (index, positions, token
count, checksum) with empty `data`; each chunk's bytes travel as one send/recv on a two-rank process group
between the prefill replica P (rank 0, `TorchSender`) and the decode replica D (rank 1, `TorchReceiver`).
The groups themselves, the rendezvous store they meet through, and how they are cached, closed and
rebuilt are pair_groups.py's.

Rendezvous. D hosts the rendezvous store, created by its first `prepare`. Before each Prefill call
`TorchReceiver.prepare` writes the store's "host:port" into `PrefillRequest.rendezvous` and a fresh
`torch_tag` (a per-process counter). P connects to that store (one client per D, cached) and, before its
first chunk message, announces the transfer under `kvrelay/kv/xfer/<tag>` (JSON): the pair group's name,
the backend, a per-group sequence number and every chunk's token count. D reads and deletes that key when
the first chunk message arrives.

Whole transfers in flight. With the announcement D knows every chunk's size, so at the first chunk
message it posts the receives of all chunks at once, and P posts all its sends as soon as the group is
there; the bytes then stream at the backend's pace while the gRPC messages only tell D, chunk by chunk,
what to check and hand on (an earlier one-send-per-message design ran at half the gRPC transport's
rate on loopback, in lockstep with the messages). One daemon thread per transfer and side waits for the
ops in order (D: then computes each checksum) and settles one asyncio future per chunk.

Pair groups. One group per (P process, D process), reused by every transfer between the two. Building
is collective: on a new group P yields the first chunk message before it builds (D builds when that
message arrives), so neither waits on the other's gRPC progress.

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
pair group, and both sides build a new one (pair_groups.py); concurrent transfers on that pair fail over
too.

Trust. D's store listens unauthenticated on every interface and gloo/NCCL carry raw bytes: like any
torch.distributed job, this transport assumes a private network between the replicas.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from services.engine.kv_export import KVExport
from services.kvtransfer.chunks import TARGET_CHUNK_BYTES, KVTransferFault, Layout, split, tokens_per_chunk
from services.kvtransfer.device_checksum import ChecksumKind, checksum_kind, kv_checksum
from services.kvtransfer.pair_groups import (
    KEY_PREFIX,
    Link,
    PairGroup,
    ReceiverGroups,
    SenderLinks,
    advertised_host,
    backend_for,
    fault,
    host_store,
    timedelta_until,
)
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb

DEFAULT_TIMEOUT_S = 30.0

T = TypeVar("T")


def _xfer_key(tag: int) -> str:
    return f"{KEY_PREFIX}/xfer/{tag}"


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


def _post_and_wait(
    group: PairGroup,
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


# ------------------------------------------------------------------------------ P side


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
        self._links = SenderLinks()

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
        link, group, replaced = await _in_thread(
            lambda: self._links.open(rendezvous, backend, deadline, self.timeout_s)
        )
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
        self, group: PairGroup, flats: list[torch.Tensor], tag: int, seq: int, deadline: float
    ) -> list[asyncio.Future[None]]:
        return _post_and_wait(group, "send", flats, tag, seq, deadline, lambda _: None)

    def _announce(self, link: Link, group: PairGroup, tag: int, announcement: _Announcement) -> None:
        try:
            link.store.set(_xfer_key(tag), announcement.encode())
        except Exception as exc:
            group.close("store unreachable")
            raise fault("announcing the transfer", exc) from exc

    def close(self) -> None:
        self._links.close()


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
    group: PairGroup | None = None
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
        self.host = host or advertised_host()
        self.device = torch.device(device)
        self.backend = backend_for(self.device)
        self._store: Any = None
        self._rendezvous = ""
        self._tags = itertools.count(1)
        self._inbound: dict[int, _Inbound] = {}
        self._groups = ReceiverGroups()

    @property
    def rendezvous(self) -> str:
        return self._rendezvous

    def prepare(self, request: kvpb.PrefillRequest) -> None:
        now = time.monotonic()
        if self._store is None:  # once per process: binding a port takes a moment, on this thread
            self._store, self._rendezvous = host_store(self.host, self.timeout_s)
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
            self._store.wait([key], timedelta_until(deadline))
            raw = self._store.get(key)
            self._store.delete_key(key)
        except KVTransferFault:
            raise
        except Exception as exc:
            raise fault(f"reading the announcement of transfer {tag}", exc) from exc
        return _Announcement.decode(raw)

    def _group_for(self, announcement: _Announcement) -> PairGroup:
        if announcement.backend != self.backend:
            raise KVTransferFault(
                f"the prefill replica sends over {announcement.backend}; KV here is on {self.device} "
                f"({self.backend})"
            )
        return self._groups.get(
            announcement.group, announcement.replaces, self.backend, self._rendezvous, self.timeout_s
        )

    def close(self) -> None:
        """Abort every pair group and release the store (call once transfers are over)."""
        self._groups.close()
        self._inbound.clear()
        self._store = None
        self._rendezvous = ""
