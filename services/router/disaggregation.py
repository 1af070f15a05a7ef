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

    def seconds(self, num_tokens: int) -> float:
        return num_tokens * self.kv_bytes_per_token / self.bytes_per_s


def decide(
    num_prompt_tokens: int,
    num_samples: int,
    min_prompt_tokens: int,
    prefill: Candidate | None,
    decode: Candidate,
    costs: CostModel,
    transfer: TransferModel,
) -> Decision:
    if prefill is None:
        return Decision(False, "no_prefill_pool")
    if num_samples > 1:
        return Decision(False, "multiple_samples")
    if num_prompt_tokens < min_prompt_tokens:
        return Decision(False, "short_prompt")
    to_send = max(0, num_prompt_tokens - decode.cached_tokens)
    remote = costs.queue_s(prefill) + costs.prefill_s(prefill, num_prompt_tokens) + transfer.seconds(to_send)
    local_prefill = costs.prefill_s(decode, num_prompt_tokens)
    local = costs.queue_s(decode) + local_prefill
    local_cost = local + decode.running * local_prefill * STALL_WEIGHT
    reason = "remote_cheaper" if remote < local_cost else "local_cheaper"
    return Decision(remote < local_cost, reason, remote, local)
