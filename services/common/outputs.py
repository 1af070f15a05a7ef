"""What a generation gives back per token, one type per concept for every service: the engine makes them,
proto_convert.py carries them across gRPC, the codec renders them.

`FinishReason` is why a sample ended. `TokenLogprob` is a sampled token's logprob with its top
alternatives as (token ID, logprob) pairs; the engine fills the IDs and numbers, and the codec adds the
text of the token and of each alternative (`token`, `top_tokens`) before a protocol renders it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # an EOS or stop token ID was sampled, or (codec) a stop string matched
    LENGTH = "length"  # max_tokens, or the model's context, was reached
    ABORT = "abort"  # aborted by the caller (cancel, deadline)
    HANDOFF = "handoff"  # prefill replica: the prompt's KV and first token went to a decode replica


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: Sequence[tuple[int, float]] = ()  # the top alternatives, when asked for: (token ID, logprob)
    token: str = ""  # the codec's text of `token_id`
    top_tokens: tuple[str, ...] = ()  # the codec's text of each `top` entry, in order
