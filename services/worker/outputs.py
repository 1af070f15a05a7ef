"""Engine outputs as internal-API messages."""

from __future__ import annotations

from services.common.proto_convert import FINISH_TO_PROTO, logprob_to_proto
from services.engine.core import RequestOutput
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb


def output_to_proto(output: RequestOutput) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        index=output.index,
        token_ids=output.new_token_ids,
        logprobs=[logprob_to_proto(lp) for lp in output.logprobs or ()],
        finish_reason=FINISH_TO_PROTO[output.finish_reason],
        num_prompt_tokens=output.num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens,
        num_cache_written_tokens=output.num_cache_written_tokens,
    )
