"""Conversions between the internal gRPC messages and the plain dataclasses both sides use. No torch.

What comes in from a peer is range-checked here, as it is converted: `engine_input_from_proto` turns a
GenerateRequest or a PrefillRequest into the values a worker hands its engine, or raises an
InvalidRequestError that names the field (INVALID_ARGUMENT on the wire), so a hostile or broken peer gets
a clear refusal before anything is queued, never an engine assertion.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.common.engine_input import (
    CacheBreakpoint,
    EngineInput,
    check_request,
)
from services.common.errors import (
    InvalidRequestError,
    InvalidSamplingError,
)
from services.common.grammar import GrammarKind, GrammarSpec
from services.common.outputs import FinishReason, TokenLogprob
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb

MAX_SESSION_KEY_LEN = 128  # the codec's are 32 hex digits

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
    if params.grammar is not None:
        grammar = params.grammar
        msg.grammar.CopyFrom(pb.Grammar(kind=grammar.kind.value, text=grammar.text, strict=grammar.strict))
    return msg


def grammar_from_proto(msg: pb.SamplingParams) -> GrammarSpec | None:
    """The request's grammar, or None; InvalidSamplingError for an unknown kind."""
    if not msg.HasField("grammar"):
        return None
    try:
        kind = GrammarKind(msg.grammar.kind)
    except ValueError:
        known = ", ".join(k.value for k in GrammarKind)
        raise InvalidSamplingError(
            f"grammar.kind must be one of {known}, got {msg.grammar.kind!r}", param="grammar"
        ) from None
    return GrammarSpec(kind, msg.grammar.text, msg.grammar.strict)


def engine_input_from_proto(
    request: pb.GenerateRequest | kvpb.PrefillRequest, vocab_size: int, request_id: str = ""
) -> EngineInput:
    """The request's values, each checked once (engine_input.check_request; InvalidRequestError names the
    first one out of range). `request_id` stands in for an empty `request.request_id` (the caller's
    x-request-id metadata)."""
    return check_request(
        request.request_id or request_id,
        request.prompt_token_ids,
        sampling_from_proto(request.sampling),
        vocab_size,
        priority=request.priority,
        cache_salt=bytes(request.cache_salt),
        cache_breakpoints=breakpoints_from_proto(request.cache_breakpoints),
        encoder_token_ids=request.encoder_token_ids,
    )


def breakpoints_to_proto(breakpoints: Sequence[CacheBreakpoint]) -> list[pb.CacheBreakpoint]:
    return [pb.CacheBreakpoint(num_tokens=p.num_tokens, ttl_s=p.ttl_s) for p in breakpoints]


def breakpoints_from_proto(breakpoints: Iterable[pb.CacheBreakpoint]) -> list[CacheBreakpoint]:
    """Converted only: `check_request` checks them against the prompt."""
    return [CacheBreakpoint(p.num_tokens, p.ttl_s) for p in breakpoints]


def session_key_from_proto(session_key: str) -> str:
    if len(session_key) > MAX_SESSION_KEY_LEN:
        raise InvalidRequestError(
            f"session_key holds {len(session_key)} characters; the limit is {MAX_SESSION_KEY_LEN}",
            param="session_key",
        )
    return session_key


def sampling_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """The parameters, not yet checked (engine_input_from_proto checks them with the rest of the request).
    Floats travel as float32; round them back so 0.9 stays 0.9 for validation and seeding."""
    params = SamplingParams(
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
        grammar=grammar_from_proto(msg),
    )
    return params


def _f(value: float) -> float:
    return float(f"{value:.7g}")
