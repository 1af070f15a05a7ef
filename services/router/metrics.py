"""The router's Prometheus metrics, served over HTTP on `--metrics-port` (off when not given).

Read at scrape time from the router's own counters: routing decisions by replica-choice reason,
disaggregation decisions (local or remote) with their reason, retries, ejections, and per-replica
state (usable, in flight, queued prompt tokens, blocks in its prefix index).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from services.common.process_metrics import register_process_metrics
from services.router.router_service import RouterService


class RouterCollector(Collector):
    def __init__(self, service: RouterService) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        service = self.service
        routes = CounterMetricFamily(
            "kvrelay_router_routes", "Requests routed, by reason.", labels=["reason"]
        )
        for reason, count in sorted(service.route_reasons.items()):
            routes.add_metric([reason], count)
        yield routes
        decisions = CounterMetricFamily(
            "kvrelay_router_disaggregation_decisions",
            "Prefill placement decisions.",
            labels=["decision", "reason"],
        )
        for (decision, reason), count in sorted(service.decisions.items()):
            decisions.add_metric([decision, reason], count)
        yield decisions
        yield CounterMetricFamily(
            "kvrelay_router_tier_tokens",
            "Prompt tokens routed to replicas expected to fetch them from the KV tiers below their pools.",
            value=service.below_tokens_routed,
        )
        index = service.replicas.tiers
        segments = GaugeMetricFamily(
            "kvrelay_router_tier_segments",
            "Segments the router knows in the tiers below the pools.",
            labels=["tier"],
        )
        segments.add_metric(["shared"], len(index.shared))
        segments.add_metric(["own"], sum(len(own) for own in index.own.values()))
        yield segments
        yield CounterMetricFamily(
            "kvrelay_router_retries", "Requests retried on another replica.", value=service.num_retries
        )
        yield CounterMetricFamily(
            "kvrelay_router_ejections",
            "Replicas ejected after failures.",
            value=service.replicas.num_ejections,
        )
        yield from self._replicas()

    def _replicas(self) -> Iterator[Metric]:
        labels = ["replica", "role"]
        usable = GaugeMetricFamily(
            "kvrelay_router_replica_usable", "1 if the replica takes new requests.", labels=labels
        )
        in_flight = GaugeMetricFamily(
            "kvrelay_router_replica_in_flight", "Requests in flight there.", labels=labels
        )
        queued = GaugeMetricFamily(
            "kvrelay_router_replica_queued_tokens",
            "Uncached prompt tokens sent there whose first token has not come back.",
            labels=labels,
        )
        indexed = GaugeMetricFamily(
            "kvrelay_router_replica_indexed_blocks",
            "Blocks in the router's prefix index for the replica.",
            labels=labels,
        )
        for r in self.service.replicas.replicas:
            values = [r.name, r.role]
            usable.add_metric(values, 1 if r.usable else 0)
            in_flight.add_metric(values, r.in_flight)
            queued.add_metric(values, r.queued_tokens)
            indexed.add_metric(values, len(r.cached))
        yield from (usable, in_flight, queued, indexed)


def serve_metrics(service: RouterService, host: str, port: int) -> CollectorRegistry:
    registry = CollectorRegistry()
    register_process_metrics(registry)
    registry.register(RouterCollector(service))
    start_http_server(port, addr=host, registry=registry)
    return registry
