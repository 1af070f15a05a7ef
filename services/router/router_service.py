"""The router's gRPC face: the Worker API, forwarded to a chosen replica, plus Replicas for status.

Per request: hash the prompt's blocks once (with the tenant salt, as the replicas do) and read each
replica's cached prefix from the prefix index; pick the decode replica (session affinity first, through
consistent hashing with bounded load, else the configured policy); then decide whether a prefill
replica runs the prompt (services/router/disaggregation.py). The decision and its reason go to the
request's log line and to `decisions`. A malformed request ID or session key is refused, and so is an ID
already being routed here (ALREADY_EXISTS: a second stream under one ID would be indistinguishable on the
replica, in Abort and in the logs). A request is retried on another replica only while no token has
gone out; the replica that failed is ejected. A client that goes away cancels the forwarded call, which
aborts the request on the worker. With tracing on, the request's "route" span continues the codec's trace
and is handed on to the decode replica in the forwarded call's metadata (docs/observability.md).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, SpanKind

from services.common import tracing
from services.common.block_hash import request_salt
from services.common.config import DisaggregationConfig, RouterConfig
from services.common.engine_input import check_request_id, check_unique
from services.common.errors import DuplicateRequestError, InvalidRequestError
from services.common.grpc_auth import request_id_of
from services.common.grpc_server import BUSY_KEY, abort_for, is_busy
from services.common.proto_convert import session_key_from_proto
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from services.router.disaggregation import Decision, TransferModel, decide
from services.router.policy import (
    AffinityRing,
    Candidate,
    Choice,
    CostModel,
    CostPolicy,
    LeastLoaded,
    Policy,
    RendezvousAffinity,
    RoundRobin,
    home_is_busy,
)
from services.router.replicas import Replica, ReplicaSet, pair_transport

log = logging.getLogger(__name__)
# A replica's failure before the first token that another replica may serve: unreachable or refusing
# (UNAVAILABLE), or cancelled by the replica itself (a server that begins to stop cancels a call that
# reached it at that moment; a client's own cancel ends this handler instead, never as this status).
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
DECODE_ROLES = frozenset({"colocated", "decode"})
PREFILL_ROLES = frozenset({"prefill"})
BANDWIDTH_EWMA = 0.2


def make_policy(config: RouterConfig, costs: CostModel) -> Policy:
    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "least_loaded":
        return LeastLoaded()
    return CostPolicy(costs)


def make_affinity(config: RouterConfig) -> RendezvousAffinity | AffinityRing | None:
    """The session affinity `router.affinity` names (None: off)."""
    if config.affinity == "shared":
        return RendezvousAffinity(load_factor=config.affinity_load_factor)
    if config.affinity == "local":
        return AffinityRing(load_factor=config.affinity_load_factor)
    return None


@dataclass
class _Route:
    decode: Replica
    choice: Choice
    prefill: Replica | None
    decision: Decision
    # Prompt tokens the decode (prefill) replica has to compute, those it does not cache, until the first
    # token: a queued prompt that is mostly a cache hit holds up the replica's next prompts only that long.
    num_decode_tokens: int
    num_prefill_tokens: int
    num_below_tokens: int = 0  # prompt tokens the decode replica is expected to fetch from its tiers
    priority: int = 0  # the request's class: its queued tokens are counted under it


class RouterService(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        replicas: ReplicaSet,
        disaggregation: DisaggregationConfig | None = None,
        config: RouterConfig | None = None,
    ) -> None:
        self.replicas = replicas
        self.disaggregation = disaggregation or DisaggregationConfig()
        self.config = config or RouterConfig()
        self.costs = CostModel(self.config.prefill_tokens_per_s, self.config.per_running_seq_ms / 1000)
        self.policy = make_policy(self.config, self.costs)
        self.prefill_policy = make_policy(self.config, self.costs)
        self.affinity = make_affinity(self.config)
        self.transfer_bytes_per_s = self.config.transfer_bytes_per_s
        self.requests_total = 0
        self.num_retries = 0
        self.in_flight: set[str] = set()  # request IDs being routed now: one stream per ID
        self.decisions: collections.Counter[tuple[str, str]] = collections.Counter()
        self.route_reasons: collections.Counter[str] = collections.Counter()
        self.below_tokens_routed = 0  # prompt tokens routed to be fetched from the tiers below the pools

    # -- choosing -------------------------------------------------------------------------------------

    def _candidates(
        self,
        roles: frozenset[str],
        exclude: set[str],
        block_hashes: list[bytes],
        block_size: int,
        request: pb.GenerateRequest,
    ) -> dict[str, tuple[Replica, Candidate]]:
        limit = max(0, len(request.prompt_token_ids) - 1) // block_size  # the last token is recomputed
        cacheable = block_hashes[:limit]
        tail_ends = {min(p.num_tokens // block_size, limit) for p in request.cache_breakpoints}
        out = {}
        for r in self.replicas.usable(roles):
            if r.name in exclude:
                continue
            load = r.load
            cached = r.cached_tokens(block_hashes, block_size) if self.config.prefix_aware else 0
            below, per_token = self._below(r, cacheable, cached, block_size, tail_ends)
            out[r.name] = (
                r,
                Candidate(
                    r.name,
                    r.in_flight,
                    r.waiting_ahead(request.priority),
                    load.running,
                    r.queued_ahead(request.priority),
                    cached,
                    below,
                    per_token,
                    r.address,
                ),
            )
        return out

    def _below(
        self,
        replica: Replica,
        hashes: list[bytes],
        num_cached_tokens: int,
        block_size: int,
        tail_ends: set[int],
    ) -> tuple[int, float]:
        """The prompt tokens after the pool's hit that `replica` would fetch from the tiers below it (those
        its Load reports up), and the seconds per token that costs there: its KV bytes per token over the
        slowest fetch rate its tiers measured (tier_bytes_per_s until one has), plus each segment's call
        latency."""
        tiers = replica.load.kv_tiers
        if not self.config.tier_aware or not tiers:
            return 0, 0.0
        cached_blocks = num_cached_tokens // block_size
        up = {t.name for t in tiers if t.up}
        end = self.replicas.tiers.below_blocks(replica.name, hashes, cached_blocks, up, tail_ends)
        num_tokens = (end - cached_blocks) * block_size
        if num_tokens <= 0:
            return 0, 0.0
        rates = [t.bytes_per_s for t in tiers if t.bytes_per_s > 0]
        rate = min(rates) if rates else self.config.tier_bytes_per_s
        latency_s = max((t.latency_ms for t in tiers), default=0.0) / 1000
        segment_tokens = max(1, self.replicas.tiers.segment_blocks * block_size)
        bytes_per_token = replica.info.kv_bytes_per_token if replica.info is not None else 0
        return num_tokens, bytes_per_token / rate + latency_s / segment_tokens

    def route(
        self, request: pb.GenerateRequest, exclude: set[str], hashes: list[bytes], block_size: int
    ) -> _Route | None:
        """The decode replica (and prefill replica, if any) for this request, skipping `exclude`.
        `hashes` are the prompt's block hashes (prompt_block_hashes), computed once per request."""
        # The tokens a prefill computes: an encoder-decoder request's source (never cached) besides its
        # decoder prompt.
        num_input = len(request.prompt_token_ids) + len(request.encoder_token_ids)
        decodes = self._candidates(DECODE_ROLES, exclude, hashes, block_size, request)
        plain = [c for _, c in decodes.values()]
        affinity = (
            self.affinity.choose(request.session_key, plain, time.monotonic())
            if self.config.policy == "cost" and self.affinity is not None
            else None
        )
        if affinity is not None and home_is_busy(decodes[affinity.name][1], plain, self.costs, num_input):
            # The session's home is busy: another replica, which fetches its prefix from below.
            pick = self.policy.choose([c for c in plain if c.name != affinity.name], num_input)
            choice = pick and Choice(pick.name, "session_moved", pick.cost_s)
        else:
            choice = affinity or self.policy.choose(plain, num_input)
        if choice is None:
            return None
        decode, decode_candidate = decodes[choice.name]
        prefill, decision = self._prefill_for(request, decode, decode_candidate, hashes, block_size)
        num_prefill = num_input - prefill.cached_tokens(hashes, block_size) if prefill else 0
        num_decode = num_input - decode_candidate.cached_tokens - decode_candidate.below_tokens
        return _Route(
            decode, choice, prefill, decision, num_decode, num_prefill, decode_candidate.below_tokens,
            request.priority,
        )  # fmt: skip

    def _prefill_for(
        self,
        request: pb.GenerateRequest,
        decode: Replica,
        decode_candidate: Candidate,
        hashes: list[bytes],
        block_size: int,
    ) -> tuple[Replica | None, Decision]:
        if self.disaggregation.policy == "never":
            return None, Decision(False, "disaggregation_off")
        prefills = self._candidates(PREFILL_ROLES, set(), hashes, block_size, request)
        if self.disaggregation.transport == "ipc":  # a prefill replica sharing D's GPU comes first
            paired = {
                n: p for n, p in prefills.items() if pair_transport("ipc", p[0].info, decode.info) == "ipc"
            }
            prefills = paired or prefills
        num_source = len(request.encoder_token_ids)
        pick = self.prefill_policy.choose(
            [c for _, c in prefills.values()], len(request.prompt_token_ids) + num_source
        )
        prefill = prefills[pick.name] if pick else None
        info = decode.info or pb.InfoResponse()
        transfer = TransferModel(
            info.kv_bytes_per_token, self.transfer_bytes_per_s, info.encoder_bytes_per_token
        )
        decision = decide(
            len(request.prompt_token_ids),
            request.sampling.n or 1,
            self.disaggregation.min_prompt_tokens,
            prefill[1] if prefill else None,
            decode_candidate,
            self.costs,
            transfer,
            num_source,
        )
        forced = self.disaggregation.policy == "always" and decision.reason == "local_cheaper"
        if forced:
            decision = Decision(True, "always", decision.remote_ttft_s, decision.local_ttft_s)
        return (prefill[0] if prefill and decision.remote else None), decision

    # -- forwarding -----------------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        """Refuses a malformed request ID or session key (INVALID_ARGUMENT) and an ID already in flight
        here (ALREADY_EXISTS) before routing: the running request keeps its stream and its replica."""
        self.requests_total += 1
        try:
            request_id = check_request_id(request.request_id or request_id_of(context))
            session_key_from_proto(request.session_key)
            check_unique(request_id, self.in_flight)
        except (InvalidRequestError, DuplicateRequestError) as exc:
            await abort_for(context, exc)
        self.in_flight.add(request_id)
        # The router's span of the request's trace (the codec's request span is its parent): the choice,
        # then the forwarded stream until its end. Never made current: this generator yields.
        span = tracing.start_span(
            "route",
            tracing.extract(context.invocation_metadata()),
            kind=SpanKind.SERVER,
            attributes={
                "kvrelay.request_id": request_id,
                "kvrelay.prompt_tokens": len(request.prompt_token_ids),
            },
        )
        try:
            async with contextlib.aclosing(self._generate(request, request_id, context, span)) as responses:
                async for response in responses:
                    yield response
        finally:
            span.end()
            self.in_flight.discard(request_id)

    async def _generate(
        self, request: pb.GenerateRequest, request_id: str, context: grpc.aio.ServicerContext, span: Span
    ) -> AsyncGenerator[pb.GenerateResponse, None]:
        tried: set[str] = set()
        failure: tuple[grpc.StatusCode, str] | None = None
        busy: tuple[grpc.StatusCode, str] | None = None  # the last full replica's refusal
        salt = request_salt(bytes(request.cache_salt), request.encoder_token_ids)
        hashes, block_size = self.replicas.prompt_block_hashes(request.prompt_token_ids, salt)
        while failure is None:
            route = self.route(request, tried, hashes, block_size)
            if route is None:
                failure = busy or (grpc.StatusCode.UNAVAILABLE, "no ready worker")
                break
            tried.add(route.decode.name)
            _trace_route(span, route, len(tried))
            sent_any = False
            call = route.decode.stub.Generate(
                self._forwarded(request, route),
                metadata=tracing.inject(self.replicas.tokens.metadata(request_id), span),
                timeout=context.time_remaining(),
            )
            self._dispatched(route, +1)
            try:
                async for response in call:
                    if not sent_any:
                        sent_any = True
                        self._first_token(route)
                    self._learn_bandwidth(response)
                    yield response
                self._log_route(request_id, route)
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RETRYABLE and not sent_any:
                    self.replicas.record_failure(route.decode, exc.code().name)
                    self.num_retries += 1
                    log.warning(
                        "retrying on another replica",
                        extra={"request_id": request_id, "replica": route.decode.name},
                    )
                    continue
                if is_busy(exc) and not sent_any:
                    # Its waiting queue is full: healthy, only busy. Another replica, no ejection; when
                    # every one is full the refusal reaches the codec (a 503 with Retry-After).
                    self.num_retries += 1
                    busy = (exc.code(), exc.details() or exc.code().name)
                    continue
                failure = (exc.code(), exc.details() or exc.code().name)
            finally:
                if not sent_any:
                    self._first_token(route)
                self._dispatched(route, -1)
                call.cancel()
        tracing.fail(span, f"{failure[0].name}: {failure[1]}")
        if failure is busy:  # every replica full: say so, for the codec's 503
            context.set_trailing_metadata(((BUSY_KEY, "1"),))
        await context.abort(*failure)

    def _forwarded(self, request: pb.GenerateRequest, route: _Route) -> pb.GenerateRequest:
        if route.prefill is None:
            return request
        forwarded = pb.GenerateRequest()
        forwarded.CopyFrom(request)
        forwarded.remote_prefill.address = route.prefill.address
        forwarded.remote_prefill.transport = pair_transport(
            self.disaggregation.transport, route.prefill.info, route.decode.info
        )
        return forwarded

    def _dispatched(self, route: _Route, delta: int) -> None:
        for replica in (route.decode, route.prefill):
            if replica is not None:
                replica.in_flight += delta
        if delta > 0:
            route.decode.queued_by_class[route.priority] += route.num_decode_tokens
            if route.prefill is not None:
                route.prefill.queued_by_class[route.priority] += route.num_prefill_tokens
            self.decisions[("remote" if route.prefill else "local", route.decision.reason)] += 1
            self.route_reasons[route.choice.reason] += 1
            self.below_tokens_routed += route.num_below_tokens

    def _first_token(self, route: _Route) -> None:
        """The prompt is done: it no longer waits ahead of others on either replica."""
        for replica, num_tokens in (
            (route.decode, route.num_decode_tokens),
            (route.prefill, route.num_prefill_tokens),
        ):
            if replica is not None:
                queued = replica.queued_by_class
                queued[route.priority] = max(0, queued[route.priority] - num_tokens)
        route.num_decode_tokens = route.num_prefill_tokens = 0

    def _learn_bandwidth(self, response: pb.GenerateResponse) -> None:
        # Over the shipping time alone: kv_transfer_seconds also holds P's prefill, which the remote estimate
        # already counts, so dividing by it would take a busy prefill replica for a slow link.
        if response.prefill_mode == pb.PREFILL_MODE_REMOTE and response.kv_link_seconds > 0:
            rate = response.kv_transfer_bytes / response.kv_link_seconds
            self.transfer_bytes_per_s += BANDWIDTH_EWMA * (rate - self.transfer_bytes_per_s)

    def _log_route(self, request_id: str, route: _Route) -> None:
        log.info(
            "routed",
            extra={
                "request_id": request_id,
                "replica": route.decode.name,
                "reason": route.choice.reason,
                "tier_tokens": route.num_below_tokens,
                "prefill": route.prefill.name if route.prefill else None,
                "disaggregation": route.decision.reason,
                "remote_ttft_s": _round(route.decision.remote_ttft_s),
                "local_ttft_s": _round(route.decision.local_ttft_s),
            },
        )

    # -- the rest of the Worker API -------------------------------------------------------------------

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        md = self.replicas.tokens.metadata(request.request_id)
        for replica in self.replicas.usable():
            try:
                await replica.stub.Abort(request, metadata=md, timeout=2.0)
            except grpc.aio.AioRpcError:
                log.warning("abort not delivered", extra={"replica": replica.name})
        return pb.AbortResponse()

    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        for replica in self.replicas.usable(DECODE_ROLES):
            if replica.info is not None:
                info = pb.InfoResponse()
                info.CopyFrom(replica.info)
                info.role = "router"
                return info
        await context.abort(grpc.StatusCode.UNAVAILABLE, "no ready worker")
        raise AssertionError("unreachable")  # context.abort raises

    async def Load(self, request: pb.LoadRequest, context: grpc.aio.ServicerContext) -> pb.LoadResponse:
        usable = self.replicas.usable()
        return pb.LoadResponse(
            running=sum(r.load.running for r in usable),
            waiting=sum(r.load.waiting for r in usable),
            requests_total=self.requests_total,
            ready=bool(self.replicas.usable(DECODE_ROLES)),
        )


def _trace_route(span: Span, route: _Route, attempt: int) -> None:
    """The route taken (the last one, when a replica failed before its first token and another took over)."""
    if not span.is_recording():
        return
    if attempt > 1:
        span.add_event("retry", {"kvrelay.replica": route.decode.name})
    span.set_attributes(
        {
            "kvrelay.replica": route.decode.name,
            "kvrelay.route_reason": route.choice.reason,
            "kvrelay.prefill_replica": route.prefill.name if route.prefill else "",
            "kvrelay.disaggregation": route.decision.reason,
            "kvrelay.attempts": attempt,
        }
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


class RouterStatusService(worker_pb2_grpc.RouterServicer):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    async def Replicas(
        self, request: pb.ReplicasRequest, context: grpc.aio.ServicerContext
    ) -> pb.ReplicasResponse:
        return pb.ReplicasResponse(
            replicas=[
                pb.Replica(
                    name=r.info.name if r.info is not None and r.info.name else r.name,
                    role=r.role,
                    address=r.address,
                    ready=r.usable,
                    load=r.load,
                    info=r.info,
                )
                for r in self.replicas.replicas
            ]
        )
