"""A step's grammar masks: which tokens each row with a grammar may take, filled on the engine thread.

Each row with a matcher (grammar_matchers.py) gets one row of an int32 bitmask, filled by llguidance
(~50-100 µs a row for a 49k vocabulary) straight into one host tensor that lives as long as the runner and
grows only when a step has more grammar rows than any before. The fill runs on the engine thread, after
the forward is queued: on a GPU it overlaps the forward; on a CPU it runs between the forward and the
sampler, so no second busy thread competes with the forward's OpenMP threads (docs/performance.md).

The row's bans (EOS and stop tokens below min_tokens; EOS under ignore_eos) are cleared from its bitmask
unless that would leave nothing allowed: then the grammar wins (it allows only what the bans forbid, e.g.
EOS once it is complete), so a masked row always has a token to sample.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.engine.layers.attention_metadata import to_device
from services.engine.layers.sampling_batch import AllowedTokens
from services.engine.scheduling.request import Request


class GrammarMask:
    """The bitmask of a step's grammar rows, for logits `vocab_size` wide on `device`."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.num_words = -(-vocab_size // 32)
        self.device = device
        self._host: torch.Tensor | None = None  # [capacity, num_words] int32, reused every step

    def fill(self, requests: Sequence[Request], banned: Sequence[Sequence[int]]) -> AllowedTokens | None:
        """The allowed tokens of the rows whose request has a matcher, with each row's `banned` tokens
        taken out where something else stays allowed; None when no row has a matcher."""
        matchers = [(i, r.matcher) for i, r in enumerate(requests) if r.matcher is not None]
        if not matchers:
            return None
        from llguidance.torch import fill_next_token_bitmask  # only a process with matchers has it

        row_ids = [i for i, _ in matchers]
        host = self._buffer(len(row_ids))
        words = host.numpy().view(np.uint32)  # [capacity, num_words], the same memory
        for slot, (i, matcher) in enumerate(matchers):
            fill_next_token_bitmask(matcher, host, slot)
            if banned[i]:
                _clear_unless_empty(words[slot], banned[i])
        bitmask = host[: len(row_ids)]  # [num_masked, num_words]
        if self.device.type != "cpu":
            # Safe to refill next step without waiting: a step with grammar rows is read back (its
            # stream synchronised) before the next one is launched (core.py, no overlap for them).
            bitmask = bitmask.to(self.device, non_blocking=True)
        return AllowedTokens(to_device(row_ids, self.device), bitmask)

    def _buffer(self, num_rows: int) -> torch.Tensor:
        if self._host is None or self._host.shape[0] < num_rows:
            pin = self.device.type == "cuda"
            self._host = torch.zeros((num_rows, self.num_words), dtype=torch.int32, pin_memory=pin)
        return self._host


def _clear_unless_empty(words: np.ndarray, token_ids: Sequence[int]) -> None:
    """Clear the bits of `token_ids` in one row, unless no bit would be left set."""
    kept = words.copy()
    for token_id in token_ids:
        if token_id >> 5 < len(kept):
            kept[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))
    if kept.any():
        words[:] = kept
