"""The replicas behind the router: membership, identity, health, load and prefix index, kept fresh.

Membership comes from discovery (a static list, or Kubernetes EndpointSlices: services/router/
discovery.py) through `apply`. A replica that leaves, or reports terminating or not ready, gets no new
requests; one that left is dropped once its in-flight requests finish.

Health: every second each replica is probed (gRPC health, then Info once, then Load). A failed probe,
a hang past PROBE_TIMEOUT_S, or an answer that does not parse marks it unhealthy; so do failed calls
(`record_failure`). A replica is ejected for a backoff that doubles with consecutive failures (up to
MAX_EJECT_S) and re-admitted by the first good probe after it. A replica whose `model_fingerprint` differs
from the pool's is never used. Every ejection and re-admission is logged with the replica's name.

Prefix index: each replica streams its KV events (block hashes stored and evicted, services/engine/
block_pool.py); `Replica.cached` mirrors what its prefix cache holds, so the policy can count a prompt's
cached leading blocks per replica (`cached_tokens`). The same streams carry the segments each replica
writes to the tiers below its pool and those it sees dropped: `tiers` (tier_index.py) holds them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common import grpc_tls
from services.common.block_hash import hash_token_blocks, root_hash
from services.common.config import TlsConfig
from services.common.grpc_auth import TokenSource
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from services.router.tier_index import TierIndex

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0
FIRST_EJECT_S = 1.0
MAX_EJECT_S = 30.0
EVENTS_RETRY_S = 1.0


@dataclass(frozen=True)
class Endpoint:
    """One replica as discovery sees it (EndpointSlice conditions; a static entry is ready)."""

    address: str  # host:port
    name: str = ""  # stable name (the pod's); the address when empty
    ready: bool = True
    serving: bool = True
    terminating: bool = False

    @property
    def accepts_new_requests(self) -> bool:
        return self.ready and not self.terminating


@dataclass
class Replica:
    name: str
    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub
    info: pb.InfoResponse | None = None
    load: pb.LoadResponse = field(default_factory=pb.LoadResponse)
    healthy: bool = False
    fingerprint_ok: bool = True
    in_flight: int = 0
    # Uncached prompt tokens dispatched here whose first token has not come back, by priority class.
    queued_by_class: collections.Counter[int] = field(default_factory=collections.Counter)
    draining: bool = False  # left discovery, terminating or not ready: no new requests
    gone: bool = False  # left discovery: dropped once idle
    num_failures: int = 0
    last_problem: str = ""  # the last probe failure's reason, logged when it changes
    ejected_until: float = 0.0
    cached: set[bytes] = field(default_factory=set)  # block hashes in its prefix cache
    events_task: asyncio.Task[None] | None = None

    @property
    def queued_tokens(self) -> int:
        return sum(self.queued_by_class.values())

    def queued_ahead(self, priority: int) -> int:
        """The queued tokens a request of class `priority` waits behind: its own class's and above."""
        return sum(n for p, n in self.queued_by_class.items() if p <= priority)

    def waiting_ahead(self, priority: int) -> int:
        """The replica's own queue ahead of a request of class `priority` (its last load report; a worker
        that does not report classes counts whole)."""
        by_class = self.load.waiting_by_priority
        if not by_class:
            return self.load.waiting
        return sum(n for p, n in by_class.items() if p <= priority)

    @property
    def role(self) -> str:
        return self.info.role if self.info is not None else "unknown"

    @property
    def usable(self) -> bool:
        return (
            self.healthy
            and self.fingerprint_ok
            and self.info is not None
            and not self.draining
            and time.monotonic() >= self.ejected_until
        )

    def cached_tokens(self, block_hashes: Sequence[bytes], block_size: int) -> int:
        """Leading prompt tokens this replica holds, from the prompt's chained block hashes."""
        num_blocks = 0
        for block_hash in block_hashes:
            if block_hash not in self.cached:
                break
            num_blocks += 1
        return num_blocks * block_size


def pair_transport(transport: str, prefill: pb.InfoResponse | None, decode: pb.InfoResponse | None) -> str:
    """The KV transport for one (prefill, decode) pair, from the router's setting and the workers' Info:
    `ipc` only where both report the same ipc_domain (one GPU, or one host's shared memory for CPU
    workers), grpc for every other pair."""
    if transport != "ipc":
        return transport
    domains = {info.ipc_domain if info is not None else "" for info in (prefill, decode)}
    return "ipc" if len(domains) == 1 and "" not in domains else "grpc"


class ReplicaSet:
    def __init__(
        self,
        addresses: Sequence[str],
        tokens: TokenSource,
        model_fingerprint: str | None = None,
        watch_kv_events: bool = True,
        tls: TlsConfig | None = None,
    ) -> None:
        self.tokens = tokens
        self.tls = tls or TlsConfig()
        self.replicas: list[Replica] = []
        # The pool's model directory, when pinned (--model-fingerprint: a manifest's model_fingerprint).
        self.pinned_fingerprint = model_fingerprint
        # The weights the pool serves: the first replica of the pinned directory (or the first at all) to
        # report defines them; prefix hashes chain from it, and a replica serving other weights is unused.
        self.model_fingerprint: str | None = None
        self.watch_kv_events = watch_kv_events
        self.tiers = TierIndex()  # what the tiers below the pools hold, from the same event streams
        self.num_ejections = 0
        self.apply([Endpoint(address, f"worker-{i}") for i, address in enumerate(addresses)])

    def usable(self, roles: frozenset[str] | None = None) -> list[Replica]:
        """Replicas that take new requests; only those whose role is in `roles`, when given."""
        return [r for r in self.replicas if r.usable and (roles is None or r.role in roles)]

    # -- membership -----------------------------------------------------------------------------------

    def apply(self, endpoints: Sequence[Endpoint]) -> None:
        """Make membership match discovery: add new replicas, drain those that left or terminate."""
        seen = {e.address: e for e in endpoints}
        known = {r.address: r for r in self.replicas}
        for endpoint in endpoints:
            replica = known.get(endpoint.address) or self._add(endpoint)
            was_draining = replica.draining
            replica.gone = False
            replica.draining = not endpoint.accepts_new_requests
            if replica.draining != was_draining:
                log.info(
                    "replica draining" if replica.draining else "replica accepting",
                    extra={"replica": replica.name, "address": replica.address},
                )
        for replica in self.replicas:
            if replica.address not in seen and not replica.gone:
                replica.gone = replica.draining = True
                log.info(
                    "replica left; draining", extra={"replica": replica.name, "address": replica.address}
                )
        self._drop_idle_gone()

    def _add(self, endpoint: Endpoint) -> Replica:
        channel = grpc_tls.channel(endpoint.address, self.tls)
        replica = Replica(
            endpoint.name or endpoint.address,
            endpoint.address,
            channel,
            worker_pb2_grpc.WorkerStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )
        self.replicas.append(replica)
        log.info("replica added", extra={"replica": replica.name, "address": replica.address})
        return replica

    def _drop_idle_gone(self) -> None:
        for replica in [r for r in self.replicas if r.gone and r.in_flight == 0]:
            self.replicas.remove(replica)
            if replica.events_task is not None:
                replica.events_task.cancel()
            with contextlib.suppress(RuntimeError):  # no running loop (tests, shutdown): nothing to close
                asyncio.get_running_loop().create_task(replica.channel.close())
            log.info("replica removed", extra={"replica": replica.name, "address": replica.address})

    # -- health ---------------------------------------------------------------------------------------

    def record_failure(self, replica: Replica, reason: str) -> None:
        """A call or probe failed: eject for a backoff that doubles with consecutive failures."""
        replica.num_failures += 1
        backoff = min(MAX_EJECT_S, FIRST_EJECT_S * 2 ** (replica.num_failures - 1))
        replica.ejected_until = time.monotonic() + backoff
        replica.healthy = False
        self.num_ejections += 1
        log.warning(
            "replica ejected",
            extra={
                "replica": replica.name,
                "address": replica.address,
                "reason": reason,
                "backoff_s": backoff,
            },
        )

    async def refresh(self) -> None:
        self._drop_idle_gone()
        self.tiers.expire()
        await asyncio.gather(*(self._probe(r) for r in self.replicas))

    async def _probe(self, replica: Replica) -> None:
        if time.monotonic() < replica.ejected_until:
            return
        try:
            check = await replica.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=PROBE_TIMEOUT_S
            )
            serving = check.status == health_pb2.HealthCheckResponse.SERVING
            md = self.tokens.metadata()
            if replica.info is None and serving:
                replica.info = await replica.stub.Info(pb.InfoRequest(), metadata=md, timeout=PROBE_TIMEOUT_S)
                self._check_fingerprint(replica)
            replica.load = await replica.stub.Load(pb.LoadRequest(), metadata=md, timeout=PROBE_TIMEOUT_S)
        except (TimeoutError, grpc.aio.AioRpcError) as exc:
            self._probe_failed(replica, _describe(exc))
            return
        if serving and not replica.healthy:
            log.info("replica healthy", extra={"replica": replica.name, "address": replica.address})
        replica.healthy = serving
        if serving:
            replica.num_failures = 0
            replica.last_problem = ""
            self._watch_events(replica)

    def _probe_failed(self, replica: Replica, reason: str) -> None:
        """A replica that was serving is ejected; one still starting is only logged, once per reason."""
        if replica.healthy:
            self.record_failure(replica, reason)
        elif reason != replica.last_problem:
            log.info(
                "replica not ready",
                extra={"replica": replica.name, "address": replica.address, "reason": reason},
            )
        replica.last_problem = reason

    def _check_fingerprint(self, replica: Replica) -> None:
        if replica.info is None:
            return
        fingerprint = replica.info.model_fingerprint
        directory = replica.info.directory_fingerprint or fingerprint  # a worker before the field: the same
        pinned = self.pinned_fingerprint
        if pinned is None or pinned in (directory, fingerprint):
            if self.model_fingerprint is None:
                self.model_fingerprint = fingerprint
            replica.fingerprint_ok = fingerprint == self.model_fingerprint
        else:
            replica.fingerprint_ok = False
        if not replica.fingerprint_ok:
            log.error(
                "replica serves another model; never used",
                extra={
                    "replica": replica.name,
                    "address": replica.address,
                    "model_fingerprint": fingerprint,
                    "directory_fingerprint": directory,
                    "expected_fingerprint": self.model_fingerprint or pinned,
                },
            )

    # -- prefix index ---------------------------------------------------------------------------------

    def prompt_block_hashes(self, prompt: Sequence[int], cache_salt: bytes) -> tuple[list[bytes], int]:
        """The prompt's chained block hashes as the replicas compute them, and the block size."""
        info = next((r.info for r in self.replicas if r.info is not None), None)
        if info is None or self.model_fingerprint is None or not info.block_size:
            return [], 1
        root = root_hash(self.model_fingerprint)
        return hash_token_blocks(root, prompt, info.block_size, cache_salt), info.block_size

    def _watch_events(self, replica: Replica) -> None:
        if not self.watch_kv_events or not replica.fingerprint_ok:
            return
        if replica.events_task is None or replica.events_task.done():
            replica.events_task = asyncio.get_running_loop().create_task(self._follow_events(replica))

    async def _follow_events(self, replica: Replica) -> None:
        """Mirror one replica's prefix cache from its KV event stream; forget it when the stream breaks."""
        try:
            call = replica.stub.KVEvents(pb.KVEventsRequest(), metadata=self.tokens.metadata())
            async for batch in call:
                if batch.snapshot:
                    replica.cached = set(batch.stored)
                else:
                    replica.cached.difference_update(batch.removed)
                    replica.cached.update(batch.stored)
                self.tiers.apply(replica.name, batch.tier_stored, batch.tier_removed)
        except grpc.aio.AioRpcError as exc:
            log.info("kv events stream ended", extra={"replica": replica.name, "reason": _describe(exc)})
        finally:
            replica.cached = set()
            self.tiers.forget(replica.name)

    async def close(self) -> None:
        for replica in self.replicas:
            if replica.events_task is not None:
                replica.events_task.cancel()
        await asyncio.gather(*(r.channel.close() for r in self.replicas))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details() or ''}".strip()
    return type(exc).__name__
