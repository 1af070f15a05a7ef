"""Replica choice, as pure code over plain data. The cost-based policy comes with the router issue."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    name: str
    in_flight: int  # requests this router has sent and not yet seen finish
    waiting: int  # the replica's own queue, from its last load report


class LeastLoaded:
    """Fewest outstanding requests (our own in-flight count plus the replica's queue); ties rotate."""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate]) -> Candidate | None:
        if not candidates:
            return None
        self._turn += 1
        ordered = sorted(
            enumerate(candidates),
            key=lambda ic: (ic[1].in_flight + ic[1].waiting, (ic[0] - self._turn) % len(candidates)),
        )
        return ordered[0][1]
