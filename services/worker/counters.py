"""What a worker moved to or from its peers (KV bytes, remote prefills, fallbacks), for Load and metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class TransferCounters:
    """What crossed to or from peers, for Load and metrics."""

    bytes_total: int = 0
    remote_prefills_total: int = 0
    fallbacks_total: int = 0
    ipc_refusals_total: int = 0  # ipc handles not openable here: the KV came over grpc instead
    # Called with each completed transfer's seconds on the decode side (the worker's histogram).
    on_transfer: Callable[[float], None] | None = None

    def observe_transfer(self, seconds: float) -> None:
        if self.on_transfer is not None:
            self.on_transfer(seconds)
