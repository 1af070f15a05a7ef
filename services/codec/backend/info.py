"""The backend's model info, fetched on first use and then kept: what the context rules, /tokenize,
/v1/models and /status read. Readiness asks the backend itself on every probe (backend/readiness.py)."""

from __future__ import annotations

from services.codec.backend.protocol import Backend, BackendInfo


class BackendInfoCache:
    def __init__(self, backend: Backend) -> None:
        self._backend = backend
        self._info: BackendInfo | None = None

    @property
    def cached(self) -> BackendInfo | None:
        """The info if it was fetched already; never waits."""
        return self._info

    async def get(self) -> BackendInfo:
        """The backend's model info; BackendUnavailableError until it first answers."""
        if self._info is None:
            self._info = await self._backend.info()
        return self._info
