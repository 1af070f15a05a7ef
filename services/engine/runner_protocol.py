"""The seam between the engine core and what runs the model: the `Runner` protocol and a step's result.

`ModelRunner` (runner.py) is the real one; tests put a fake at exactly this seam. Every method runs on
the engine thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from services.common.outputs import TokenLogprob
from services.engine.scheduling.request import Request, SeqId
from services.engine.scheduling.scheduler import SchedulerOutput


@dataclass
class StepResult:
    """The token sampled for each chunk that reached the end of its known tokens, by sequence."""

    sampled: dict[SeqId, TokenLogprob]


class PendingStep(Protocol):
    """A launched step whose sampled tokens may still be on the device."""

    def collect(self) -> StepResult:
        """Wait for the step's tokens and read them back (the step's one host synchronisation)."""
        ...


@dataclass
class ReadyStep:
    """A step that finished at launch (a synchronous runner): `collect` returns its result."""

    result: StepResult

    def collect(self) -> StepResult:
        return self.result


class Runner(Protocol):
    """Computes a scheduled step over the paged KV cache and samples; moves KV in and out of blocks."""

    @property
    def weight_dtype(self) -> torch.dtype:
        """The dtype the model's weights are stored in."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the KV cache lives (and the model runs)."""
        ...

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache's dtype (what `read_kv` returns and `write_kv` stores)."""
        ...

    def set_before_forward(self, hook: Callable[[], None] | None) -> None:
        """Call `hook` (None: nothing) right before each forward, once the step's inputs are built."""
        ...

    def execute(self, step: SchedulerOutput) -> StepResult:
        """Write the KV of every scheduled chunk into its blocks and sample where a chunk samples."""
        ...

    def launch(self, step: SchedulerOutput) -> PendingStep:
        """`execute` without waiting for the sampled tokens. A token of the step's inputs that is a
        PLACEHOLDER (request.py) was sampled by the previous launch: its value is read on the device."""
        ...

    def read_kv(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """A copy of the KV at positions start..end-1: [num_layers, end - start, 2, kv_heads, head_dim]."""
        ...

    def write_kv(self, block_ids: list[int], start: int, kv: torch.Tensor) -> None:
        """Store `kv` [num_layers, num_tokens, 2, kv_heads, head_dim] at positions start.. ."""
        ...

    def write_cross(self, request: Request, encoder_states: torch.Tensor) -> None:
        """An encoder-decoder request's cross KV from a shipped encoder output [S, d_model]."""
        ...

    def take_encoder_times(self) -> list[float]:
        """Seconds of each batched encoder pass since the last call (encoder-decoder models)."""
        ...
