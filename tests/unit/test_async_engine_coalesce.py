"""Outputs that queue up while a reader is behind leave as one message per sample, in order."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from services.common.outputs import FinishReason, TokenLogprob
from services.engine.async_engine import _coalesce
from services.engine.core import RequestOutput


def _out(
    index: int, token_id: int, reason: FinishReason | None = None, logprobs: bool = False
) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        index=index,
        new_token_ids=[token_id],
        logprobs=[TokenLogprob(token_id, -0.5)] if logprobs else None,
        finish_reason=reason,
        num_prompt_tokens=3,
        num_cached_tokens=0,
    )


def _queue(*items: RequestOutput | BaseException) -> asyncio.Queue[RequestOutput | BaseException]:
    queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_merges_queued_tokens_of_one_sample_up_to_its_finish() -> None:
    queue = _queue(_out(0, 2, logprobs=True), _out(0, 3, FinishReason.LENGTH, logprobs=True))
    merged, held = _coalesce(_out(0, 1, logprobs=True), queue)
    assert isinstance(merged, RequestOutput)
    assert merged.new_token_ids == [1, 2, 3]
    assert [lp.token_id for lp in merged.logprobs or []] == [1, 2, 3]
    assert merged.finish_reason is FinishReason.LENGTH
    assert held is None and queue.empty()


def test_an_encoder_pass_on_the_first_output_survives_the_merge() -> None:
    """An encoder-decoder sequence's first output carries its encoder pass (the worker's encode span)."""
    first = replace(_out(0, 1), encode_times_ns=(100, 250))
    merged, _ = _coalesce(first, _queue(_out(0, 2), _out(0, 3)))
    assert isinstance(merged, RequestOutput) and merged.encode_times_ns == (100, 250)


def test_stops_at_another_sample_and_hands_it_back() -> None:
    other = _out(1, 9)
    queue = _queue(_out(0, 2), other, _out(0, 3))
    merged, held = _coalesce(_out(0, 1), queue)
    assert isinstance(merged, RequestOutput) and merged.new_token_ids == [1, 2]
    assert held is other
    assert queue.qsize() == 1


def test_never_merges_past_a_finished_output_or_an_error() -> None:
    error = RuntimeError("engine died")
    merged, held = _coalesce(_out(0, 1), _queue(error))
    assert isinstance(merged, RequestOutput) and merged.new_token_ids == [1]
    assert held is error
    finished = _out(0, 1, FinishReason.STOP)
    queue = _queue(_out(0, 2))
    assert _coalesce(finished, queue) == (finished, None)
    assert queue.qsize() == 1
