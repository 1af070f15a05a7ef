"""Engine outputs as internal-API messages."""

from __future__ import annotations

from services.common.proto_convert import FINISH_TO_PROTO
from services.engine.core import RequestOutput
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb


def output_to_proto(output: RequestOutput) -> pb.GenerateResponse:
    logprobs = [
        pb.TokenLogprob(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
        for lp in output.logprobs or ()
    ]
    reason = output.finish_reason.value if output.finish_reason is not None else None
    return pb.GenerateResponse(
        index=output.index,
        token_ids=output.new_token_ids,
        logprobs=logprobs,
        finish_reason=FINISH_TO_PROTO[reason],
        num_prompt_tokens=output.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens,
    )
