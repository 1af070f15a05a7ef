"""The protocol-neutral generation layer: token deltas in, per-sample text events out."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.codec.backend.protocol import (
    BackendFailedError,
    BackendUnavailableError,
    GenerationRequest,
    TokenDelta,
)
from services.codec.generation import (
    GenerationEvent,
    Generator,
    SampleFinished,
    TextDelta,
    Usage,
)
from services.codec.metrics import CodecMetrics, RequestStats
from services.codec.text.tokenizer import Tokenizer
from services.common.outputs import FinishReason
from services.common.sampling import SamplingParams
from tests.codec_fakes import FakeBackend, scripted, token_deltas

pytestmark = pytest.mark.model

PROMPT = [1, 4093, 198, 19556, 2, 198]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def fake() -> FakeBackend:
    return FakeBackend("tokenizer-fp")


@pytest.fixture
def generator(fake: FakeBackend, tokenizer: Tokenizer) -> Generator:
    return Generator(fake, tokenizer, CodecMetrics())


async def run(
    generator: Generator, stop: tuple[str, ...] = (), **sampling: int | tuple[int, ...]
) -> list[GenerationEvent]:
    request = GenerationRequest("r1", PROMPT, SamplingParams(**sampling), stop)  # type: ignore[arg-type]
    stream = await generator.start(request, RequestStats("r1"))
    try:
        return [event async for event in stream]
    finally:
        await stream.aclose()


def texts(events: list[GenerationEvent], index: int = 0) -> list[str]:
    return [event.text for event in events if isinstance(event, TextDelta) and event.index == index]


def finishes(events: list[GenerationEvent]) -> dict[int, SampleFinished]:
    return {event.index: event for event in events if isinstance(event, SampleFinished)}


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 4])
async def test_stop_string_is_cut_whatever_the_token_split(
    generator: Generator, fake: FakeBackend, tokenizer: Tokenizer, chunk_size: int
) -> None:
    fake.script = scripted([tokenizer.encode("Hello world! END and more")], chunk_size=chunk_size)
    events = await run(generator, stop=("d! E",))
    assert "".join(texts(events)) == "Hello worl"
    assert finishes(events)[0] == SampleFinished(0, FinishReason.STOP, "d! E", finishes(events)[0].num_tokens)
    assert fake.closed_early == ["r1"] and fake.completed == []


async def test_only_a_possible_stop_prefix_is_held_back(
    generator: Generator, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([tokenizer.encode("Hello world! END")])
    events = await run(generator, stop=("ENDX", "xyz"))
    assert texts(events) == ["Hello", " world", "!", " ", "END"]  # "END" could start "ENDX": held to the end
    assert finishes(events)[0].stop is None
    assert fake.completed == ["r1"]


async def test_a_stop_token_is_not_output_text(
    generator: Generator, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([tokenizer.encode("Hello world")], eos_token_id=17)  # ends with "!" as stop ID
    events = await run(generator, stop_token_ids=(17,))
    assert "".join(texts(events)) == "Hello world"
    assert finishes(events)[0].reason is FinishReason.STOP
    assert finishes(events)[0].num_tokens == 3


async def test_samples_stop_independently_and_usage_counts_what_each_used(
    generator: Generator, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted(
        [tokenizer.encode("Hello world! END"), tokenizer.encode(" café END")], num_cached_tokens=4
    )
    events = await run(generator, stop=("!",), n=2)
    assert "".join(texts(events, 0)) == "Hello world"
    assert "".join(texts(events, 1)) == " café END"
    assert finishes(events)[0].stop == "!" and finishes(events)[1].stop is None
    assert events[-1] == Usage(
        num_prompt_tokens=len(PROMPT), num_completion_tokens=3 + 3, num_cached_tokens=4
    )
    assert fake.closed_early == ["r1"]  # sample 0 would have gone on behind us


async def test_logprobs_ride_with_text_and_none_are_lost(
    generator: Generator, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([tokenizer.encode("Hello world")], logprobs=True)
    events = await run(generator, stop=("d!",), logprobs=1)
    deltas = [event for event in events if isinstance(event, TextDelta)]
    assert [(d.text, [lp.token for lp in d.logprobs]) for d in deltas] == [
        ("Hello", ["Hello"]),
        (" worl", [" world"]),
        ("d", ["<|im_end|>"]),  # held "d" released at the end, with the EOS logprob
    ]
    assert [len(lp.top) for d in deltas for lp in d.logprobs] == [1, 1, 1]


async def test_engine_abort_is_a_backend_failure(generator: Generator, fake: FakeBackend) -> None:
    fake.script = lambda request: token_deltas([19556, 905], "abort")
    with pytest.raises(BackendFailedError):
        await run(generator)
    assert generator.num_running == 0


async def test_a_stream_that_ends_before_finishing_is_a_backend_failure(
    generator: Generator, fake: FakeBackend
) -> None:
    fake.script = lambda request: token_deltas([19556, 905], "stop")[:1]
    with pytest.raises(BackendFailedError):
        await run(generator)


async def test_backend_errors_raise_from_start_before_any_event(
    generator: Generator, fake: FakeBackend
) -> None:
    fake.is_unavailable = True
    with pytest.raises(BackendUnavailableError):
        await run(generator)
    fake.is_unavailable = False
    fake.script = lambda request: []
    with pytest.raises(BackendFailedError):
        await run(generator)
    assert (generator.num_running, generator.num_requests_total) == (0, 2)


async def test_backend_sees_token_ids_sampling_and_deadline(
    generator: Generator, fake: FakeBackend, tokenizer: Tokenizer
) -> None:
    fake.script = scripted([tokenizer.encode("Hi")])
    request = GenerationRequest("r9", PROMPT, SamplingParams(max_tokens=7, seed=3), timeout_s=12.5)
    stream = await generator.start(request, RequestStats("r9"))
    assert generator.num_running == 1
    events = [event async for event in stream]
    await stream.aclose()
    await stream.aclose()  # idempotent
    assert generator.num_running == 0
    assert isinstance(events[-1], Usage)
    seen: GenerationRequest = fake.seen[0]
    assert (seen.request_id, seen.prompt_token_ids, seen.timeout_s) == ("r9", PROMPT, 12.5)
    assert (seen.sampling.max_tokens, seen.sampling.seed) == (7, 3)


def test_token_deltas_helper_marks_only_the_last_delta_finished() -> None:
    deltas: list[TokenDelta] = token_deltas([1, 2, 3], "length", chunk_size=2)
    assert [d.token_ids for d in deltas] == [[1, 2], [3]]
    assert [d.finish_reason for d in deltas] == [None, "length"]
