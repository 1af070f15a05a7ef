"""Readiness: the backend answers, and its tokenizer is the one this codec encodes with.

A codec whose tokenizer differs from the workers' would send token IDs that mean something else, so
a fingerprint mismatch keeps it not ready. Each change of state is logged once (not on every probe).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from services.codec.backend.protocol import Backend, BackendInfo, BackendUnavailableError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadinessResult:
    is_ready: bool
    reason: str
    info: BackendInfo | None = None


class Readiness:
    def __init__(self, backend: Backend, tokenizer_fingerprint: str) -> None:
        self._backend = backend
        self._tokenizer_fingerprint = tokenizer_fingerprint
        self._last_reason: str | None = None

    async def check(self) -> ReadinessResult:
        """Asks the backend now (no cache), so a restarted or swapped backend is noticed."""
        try:
            info = await self._backend.info()
        except BackendUnavailableError as exc:
            return self._report(ReadinessResult(False, f"backend unavailable: {exc}"))
        if info.tokenizer_fingerprint != self._tokenizer_fingerprint:
            reason = (
                f"tokenizer fingerprint mismatch: codec {self._tokenizer_fingerprint}, "
                f"backend {info.tokenizer_fingerprint}"
            )
            return self._report(ReadinessResult(False, reason, info))
        return self._report(ReadinessResult(True, "ready", info))

    def _report(self, result: ReadinessResult) -> ReadinessResult:
        if result.reason != self._last_reason:
            self._last_reason = result.reason
            level = logging.INFO if result.is_ready else logging.WARNING
            logger.log(level, "codec %s: %s", "ready" if result.is_ready else "not ready", result.reason)
        return result
