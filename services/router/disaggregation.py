"""Per request: prefill on a prefill replica and ship the KV, or prefill on the decode replica itself?
Pure code over the same estimates as the replica policy (services/router/policy.py).

    remote_ttft = P's queue + P's prefill of what P does not cache + transfer of what D does not hold
    local_ttft  = D's queue + D's prefill of what D does not cache
    local_cost  = local_ttft + D's running streams x that prefill x STALL_WEIGHT

A local prefill shares D's steps with its running streams, so each of them slows while it runs; the
STALL_WEIGHT prices that slowdown against one request's TTFT. Remote wins when it is cheaper. Every
decision has a reason, for metrics and the request's log line.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.policy import Candidate, CostModel

STALL_WEIGHT = 0.25


@dataclass(frozen=True)
class Decision:
    remote: bool
    reason: str  # no_prefill_pool | multiple_samples | short_prompt | remote_cheaper | local_cheaper
    remote_ttft_s: float | None = None
    local_ttft_s: float | None = None


@dataclass(frozen=True)
class TransferModel:
    kv_bytes_per_token: int
    bytes_per_s: float
    # An encoder-decoder model's: a source token's encoder output, which travels instead of its cross KV.
    encoder_bytes_per_token: int = 0

    def seconds(self, num_tokens: int, num_source_tokens: int = 0) -> float:
        num_bytes = num_tokens * self.kv_bytes_per_token + num_source_tokens * self.encoder_bytes_per_token
        return num_bytes / self.bytes_per_s


def decide(
    num_prompt_tokens: int,
    num_samples: int,
    min_prompt_tokens: int,
    prefill: Candidate | None,
    decode: Candidate,
    costs: CostModel,
    transfer: TransferModel,
    num_source_tokens: int = 0,
) -> Decision:
    """Prefill on P (remote) or on D. An encoder-decoder request's `num_source_tokens` count as prefill
    work on either side, and travel as encoder output (TransferModel.encoder_bytes_per_token), not KV."""
    if prefill is None:
        return Decision(False, "no_prefill_pool")
    if num_samples > 1:
        return Decision(False, "multiple_samples")
    num_input = num_prompt_tokens + num_source_tokens
    if num_input < min_prompt_tokens:
        return Decision(False, "short_prompt")
    to_send = max(0, num_prompt_tokens - decode.cached_tokens)
    shipping = transfer.seconds(to_send, num_source_tokens)
    remote = costs.queue_s(prefill) + costs.prefill_s(prefill, num_input) + shipping
    local_prefill = costs.prefill_s(decode, num_input)
    local = costs.queue_s(decode) + local_prefill
    local_cost = local + decode.running * local_prefill * STALL_WEIGHT
    reason = "remote_cheaper" if remote < local_cost else "local_cheaper"
    return Decision(remote < local_cost, reason, remote, local)
