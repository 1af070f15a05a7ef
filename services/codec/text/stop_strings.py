"""Streaming stop strings: text deltas in, text that is safe to emit out.

The matcher holds back only the longest suffix of the text seen so far that could still be the
start of a stop string, so ordinary text streams without delay and a partial stop string is
never emitted and then retracted.

The match reported is the one that completes first while reading left to right (the smallest
end position; on a tie, the longest stop string). That is where generation would stop, and it
does not depend on how the text was split into pushes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.common.errors import InvalidRequestError

# A matcher holds back up to the longest stop string's length of text: a longer one would stall the stream.
MAX_STOP_STRING_CHARS = 512


@dataclass(frozen=True, slots=True)
class StopResult:
    """`text` may be emitted now. When `stop` is set, the stream ends: `text` excludes the stop
    string and everything after it."""

    text: str
    stop: str | None = None


class StopStringMatcher:
    """Finds stop strings in one sequence's streamed text. After a match, input is discarded."""

    def __init__(self, stop: Sequence[str]) -> None:
        if any(not isinstance(s, str) or s == "" for s in stop):
            raise InvalidRequestError("stop strings must be non-empty strings", param="stop")
        self._stops: tuple[str, ...] = tuple(dict.fromkeys(stop))
        self._held = ""
        self.matched_stop: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.matched_stop is not None

    def push(self, text: str) -> StopResult:
        """Adds streamed text; returns what is safe to emit and the stop string if one completed."""
        if self.is_stopped:
            return StopResult("")
        buffer = self._held + text
        match = self._first_match(buffer)
        if match is not None:
            start, stop = match
            self._held = ""
            self.matched_stop = stop
            return StopResult(buffer[:start], stop)
        num_held = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return StopResult(buffer[: len(buffer) - num_held])

    def flush(self) -> str:
        """Returns the held-back text at the end of a stream that matched no stop string."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        """(start, stop) of the match that ends first; on a tie, the longest stop string."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for stop in self._stops:
            start = buffer.find(stop)
            if start < 0:
                continue
            candidate = (start + len(stop), -len(stop), stop)
            if best is None or candidate < best:
                best = candidate
        if best is None:
            return None
        end, _, stop = best
        return end - len(stop), stop

    def _partial_match_len(self, buffer: str) -> int:
        return partial_match_len(buffer, self._stops)


def partial_match_len(buffer: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `buffer` that is a proper prefix of some marker: the text to
    hold back while it could still become one (stop strings, tool call and thinking markers)."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(buffer)), longest, -1):
            if buffer.endswith(marker[:length]):
                longest = length
                break
    return longest
