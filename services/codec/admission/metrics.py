"""Admission-control instruments, registered on the codec app's own registry (`CodecMetrics.registry`).

    kvrelay_admission_rejections_total{tenant, reason}   refusals: a quota window (tenant_/global_
                                                         requests_/tokens_per_minute), queue_full,
                                                         queue_pushed_out, queue_timeout, quota_store_down
    kvrelay_admission_running                            requests holding a concurrency slot
    kvrelay_admission_queued                             requests waiting in the fair queue
    kvrelay_quota_open_reservations                      quota reservations not yet settled or released
    kvrelay_quota_reserved_tokens                        tokens those reservations hold
    kvrelay_quota_store_errors_total{operation, outcome} the quota store (Redis) failed: operation
                                                         reserve|settle|release, outcome fallback
                                                         (fail open: this process's share) |
                                                         admitted (nothing to check) | refused
                                                         (fail closed) | lost
    kvrelay_step_timeouts_total                          requests aborted by limits.step_timeout_ms
    kvrelay_encoder_timeouts_total                       encoder-decoder requests aborted by
                                                         limits.encoder_timeout_ms (no first token)

Tenant labels are bounded by the configured API keys (open mode has the one tenant "default").
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class LimitsMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        registry = registry if registry is not None else CollectorRegistry()
        self.rejections = Counter(
            "kvrelay_admission_rejections_total",
            "Requests refused by admission control, by tenant and reason.",
            ["tenant", "reason"],
            registry=registry,
        )
        self.running = Gauge(
            "kvrelay_admission_running", "Requests holding a concurrency slot.", registry=registry
        )
        self.queued = Gauge(
            "kvrelay_admission_queued", "Requests waiting in the fair queue for a slot.", registry=registry
        )
        self.open_reservations = Gauge(
            "kvrelay_quota_open_reservations",
            "Quota reservations not yet settled or released.",
            registry=registry,
        )
        self.reserved_tokens = Gauge(
            "kvrelay_quota_reserved_tokens",
            "Tokens held by quota reservations not yet settled or released.",
            registry=registry,
        )
        self.store_errors = Counter(
            "kvrelay_quota_store_errors_total",
            "Quota store (Redis) failures, by operation and what was done about it.",
            ["operation", "outcome"],
            registry=registry,
        )
        self.step_timeouts = Counter(
            "kvrelay_step_timeouts_total",
            "Requests aborted because the next token took longer than limits.step_timeout_ms.",
            registry=registry,
        )
        self.encoder_timeouts = Counter(
            "kvrelay_encoder_timeouts_total",
            "Encoder-decoder requests aborted because their first token took longer than "
            "limits.encoder_timeout_ms.",
            registry=registry,
        )

    def reject(self, tenant: str, reason: str) -> None:
        self.rejections.labels(tenant=tenant, reason=reason).inc()
