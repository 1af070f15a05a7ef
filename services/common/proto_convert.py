"""Conversions between the internal gRPC messages and the plain dataclasses both sides use. No torch."""

from __future__ import annotations

from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb

# HANDOFF never crosses: a prefill replica's handoff is the header's first token, not a finish.
FINISH_TO_PROTO: dict[FinishReason | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO: dict[pb.FinishReason, FinishReason | None] = {v: k for k, v in FINISH_TO_PROTO.items()}


def logprob_to_proto(logprob: TokenLogprob) -> pb.TokenLogprob:
    top = [pb.TopLogprob(token_id=t, logprob=v) for t, v in logprob.top]
    return pb.TokenLogprob(token_id=logprob.token_id, logprob=logprob.logprob, top=top)


def logprob_from_proto(msg: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(msg.token_id, msg.logprob, [(t.token_id, t.logprob) for t in msg.top])


def sampling_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        frequency_penalty=params.frequency_penalty,
        presence_penalty=params.presence_penalty,
        max_tokens=params.max_tokens,
        min_tokens=params.min_tokens,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        n=params.n,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """Floats travel as float32; round them back so 0.9 stays 0.9 for validation and seeding."""
    return SamplingParams(
        n=msg.n or 1,
        temperature=_f(msg.temperature),
        top_p=_f(msg.top_p),
        top_k=msg.top_k,
        min_p=_f(msg.min_p),
        repetition_penalty=_f(msg.repetition_penalty),
        frequency_penalty=_f(msg.frequency_penalty),
        presence_penalty=_f(msg.presence_penalty),
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens,
        min_tokens=msg.min_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
    )


def _f(value: float) -> float:
    return float(f"{value:.7g}")
