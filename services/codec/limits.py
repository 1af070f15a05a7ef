"""Admission control around one generation: the quota reservation, then a concurrency slot, and what
gives both back.

Order: quotas (quotas.py; over quota is a 429 at once and nothing is held), then a slot
(concurrency.py; may wait its turn in the fair queue, refused with 503/529 when the queue is full),
then the backend (`Generator.start`). The `Lease` holds the reservation and the slot; it is closed
exactly once, when the generation stream closes (finished, failed, step timeout, client gone) or
when starting fails:

- the backend produced no token (never sent, refused, down, or the client left before the first
  token): the reservation is released whole, request and tokens;
- otherwise it is settled to the tokens really used (prompt + tokens generated so far).

Either way the slot is freed (and passed to the next waiter). The Redis key prefix of the shared quota
counters comes from `KVRELAY_QUOTAS_KEY_PREFIX` (default "{kvrelay-quota}:"), so that deployments and
tests sharing one Redis keep their counters apart.
"""

from __future__ import annotations

from collections.abc import Mapping

import anyio

from services.codec.concurrency import FairLimiter, Slot
from services.codec.limits_metrics import LimitsMetrics
from services.codec.quotas import DEFAULT_KEY_PREFIX, Quotas, Reservation
from services.common.config import KvrelayConfig

KEY_PREFIX_ENV = "KVRELAY_QUOTAS_KEY_PREFIX"


class Lease:
    """A reservation and a slot, given back by `close` (idempotent, never raises, not cancellable)."""

    def __init__(self, quotas: Quotas, reservation: Reservation, slot: Slot) -> None:
        self._quotas = quotas
        self.reservation = reservation
        self._slot = slot
        self._is_closed = False

    @property
    def waited_s(self) -> float | None:
        """Time spent waiting in the fair queue; None when a slot was free at once."""
        return self._slot.waited_s

    async def close(self, tokens_used: int | None) -> None:
        """`tokens_used` None: the backend produced nothing, so everything is released."""
        if self._is_closed:
            return
        self._is_closed = True
        try:
            with anyio.CancelScope(shield=True):
                if tokens_used is None:
                    await self._quotas.release(self.reservation)
                else:
                    await self._quotas.settle(self.reservation, tokens_used)
        finally:
            self._slot.release()


class AdmissionLimits:
    """Quotas and the fair limiter of one codec."""

    def __init__(
        self, config: KvrelayConfig, quotas: Quotas, limiter: FairLimiter, metrics: LimitsMetrics
    ) -> None:
        self._quotas_config = config.quotas
        self.quotas = quotas
        self.limiter = limiter
        self.metrics = metrics

    @classmethod
    def from_config(
        cls, config: KvrelayConfig, metrics: LimitsMetrics, environ: Mapping[str, str]
    ) -> AdmissionLimits:
        key_prefix = environ.get(KEY_PREFIX_ENV, "").strip() or DEFAULT_KEY_PREFIX
        quotas = Quotas.from_config(config.quotas, metrics, key_prefix=key_prefix)
        limiter = FairLimiter(config.limits.concurrency_limit, config.limits.queue_limit, metrics)
        return cls(config, quotas, limiter, metrics)

    async def enter(self, tenant: str, num_tokens: int, timeout_s: float | None) -> Lease:
        """Reserves `num_tokens` (prompt + n × max_tokens) and a request for `tenant`, then waits for a
        slot until `timeout_s`. Raises RateLimitedError, QuotaUnavailableError or OverloadedError,
        holding nothing afterwards."""
        reservation = await self.quotas.reserve(tenant, num_tokens)
        weight, cap = self.fairness_of(tenant)
        try:
            slot = await self.limiter.acquire(tenant, weight=weight, cap=cap, timeout_s=timeout_s)
        except BaseException:
            await self.quotas.release(reservation)  # shielded inside
            raise
        return Lease(self.quotas, reservation, slot)

    def fairness_of(self, tenant: str) -> tuple[int, int | None]:
        """(weight in the fair queue, concurrency cap or None) from quotas.tenants, else the defaults."""
        own = self._quotas_config.tenants.get(tenant)
        if own is None:
            return 1, self._quotas_config.default_max_concurrency
        return own.weight, own.max_concurrency or self._quotas_config.default_max_concurrency

    async def aclose(self) -> None:
        await self.quotas.aclose()
