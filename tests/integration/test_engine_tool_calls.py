"""Forced tool calls and thinking blocks through the engine, on tiny random-weight models that spell with
SmolLM2's tokenizer plus their family's markers as added tokens (tests/tool_model_helpers.py): a
Qwen3-style model with `<tool_call>` `</tool_call>` `<think>` `</think>` (Hermes calls) and a Llama with
`<|python_tag|>` (Llama 3 calls). Their unconstrained output is noise, so a call that parses and validates
is the grammar's doing.

Each family's forced requests run in one engine (50 seeds under tool_choice required, temperature 1, and
a few under a named choice); every call is read back by the codec's `CallParser`, fed the decoded text
token by token, and its arguments validated against the named tool's schema. Then the same requests
across a preemption, across the engine-level prefill -> decode handoff, and across a real prefill worker
and decode worker pair. Last, thinking within a 16-token budget: alone, and followed by a forced call.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer

from services.codec.text.reasoning import AnswerPiece, ReasoningParser, ReasoningPiece, thinking_grammar
from services.codec.text.tool_calls import (
    HERMES,
    LLAMA3,
    CallEnded,
    CallFormat,
    CallStarted,
    ParseEvent,
    TextPiece,
    Tool,
    ToolChoice,
    ToolChoiceMode,
    ToolSet,
    detect_format,
)
from services.common.grammar import GrammarSpec
from services.common.outputs import FinishReason
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from tests.integration.test_disaggregation_grammar import MD, PDPair
from tests.integration.test_engine_structured_output import Runs, Sample, engine_for, run
from tests.stack_helpers import wait_idle
from tests.tool_model_helpers import (
    LLAMA3_MARKERS,
    QWEN3_MARKERS,
    decode_keeping_markers,
    make_tiny_llama3_with_markers,
    make_tiny_qwen3_with_markers,
    marker_ids,
)
from tests.unit.test_engine_remote_kv import prefill

pytestmark = pytest.mark.model  # SmolLM2's tokenizer files come from the prepared model directory

NUM_SEEDS = 50
NUM_NAMED = 10
MAX_TOKENS = 160
BUDGET = 16
PROMPT = (
    "You are a helpful assistant with tools. Look up the weather in Paris for the next three days, "
    "then set the display mode to fast. Call a tool:"
)
TOOLS = (
    Tool(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    ),
    Tool(
        "set_mode",
        {
            "type": "object",
            "properties": {
                "label": {"type": "string", "maxLength": 8},
                "mode": {"enum": ["fast", "slow", "off"]},
            },
            "required": ["label", "mode"],
            "additionalProperties": False,
        },
    ),
)
REQUIRED = ToolSet(TOOLS, ToolChoice(ToolChoiceMode.REQUIRED, parallel=False))
NAMED = ToolSet(TOOLS, ToolChoice(ToolChoiceMode.NAMED, name="set_mode"))  # parallel calls allowed


@dataclass(frozen=True)
class Family:
    name: str
    path: Path
    tokenizer: Tokenizer
    call_format: CallFormat  # with the markers' token IDs

    @property
    def prompt(self) -> list[int]:
        return list(self.tokenizer.encode(PROMPT).ids)

    def text(self, sample: Sample) -> str:
        return decode_keeping_markers(self.tokenizer, sample.token_ids)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # the arguments' JSON text

    @property
    def value(self) -> Any:
        """The arguments, parsed; None when the text is no JSON (a call cut short at max_tokens)."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return None

    def same_as(self, other: Call) -> bool:
        """The same call, its arguments perhaps spaced differently."""
        parsed = self.value is not None
        return self.name == other.name and (self.value == other.value if parsed else self == other)


def sampled(seed: int, grammar: GrammarSpec | None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, grammar=grammar)


def forced_requests(family: Family) -> dict[str, SamplingParams]:
    required, named = family.call_format.grammar(REQUIRED), family.call_format.grammar(NAMED)
    requests = {f"required-{seed}": sampled(seed, required) for seed in range(NUM_SEEDS)}
    requests |= {f"named-{seed}": sampled(seed, named, max_tokens=64) for seed in range(NUM_NAMED)}
    return requests


def thinking(family: Family, answer: GrammarSpec | None) -> GrammarSpec | None:
    """The thinking grammar of a prompt that opened the block, within BUDGET tokens, then `answer`;
    `</think>` named by its token ID, as the codec does where it is one token."""
    end_id = family.tokenizer.token_to_id("</think>")
    return thinking_grammar(answer, BUDGET, opened=True, end_id=end_id)


def text_pieces(tokenizer: Tokenizer, token_ids: Sequence[int]) -> list[str]:
    """The decoded text as a stream sends it: one piece per token, a piece held while it ends inside a
    UTF-8 sequence (its replacement character)."""
    pieces, sent = [], ""
    for count in range(1, len(token_ids) + 1):
        text = decode_keeping_markers(tokenizer, token_ids[:count])
        if text.endswith("\ufffd") and count < len(token_ids):
            continue
        assert text.startswith(sent), (sent, text)
        if len(text) > len(sent):
            pieces.append(text[len(sent) :])
        sent = text
    return pieces


def parse_calls(family: Family, tools: ToolSet, sample: Sample) -> tuple[list[Call], str]:
    """The sample's calls and the text around them, its text fed to the parser one token at a time; the
    same as feeding it whole."""
    calls, text = _parse(family.call_format, tools, text_pieces(family.tokenizer, sample.token_ids))
    whole_calls, whole_text = _parse(family.call_format, tools, [family.text(sample)])
    assert text == whole_text and len(calls) == len(whole_calls), family.text(sample)
    assert all(a.same_as(b) for a, b in zip(calls, whole_calls, strict=True)), (calls, whole_calls)
    return calls, text


def _parse(call_format: CallFormat, tools: ToolSet, pieces: Sequence[str]) -> tuple[list[Call], str]:
    parser = call_format.parser(tools)
    events: list[ParseEvent] = []
    for piece in pieces:
        events += parser.push(piece)
    events += parser.finish()
    names = {e.call_index: e.name for e in events if isinstance(e, CallStarted)}
    calls = [Call(names[e.call_index], e.arguments) for e in events if isinstance(e, CallEnded)]
    return calls, "".join(e.text for e in events if isinstance(e, TextPiece))


def assert_valid(calls: Sequence[Call], tools: ToolSet, where: str) -> None:
    for call in calls:
        tool = tools.tool(call.name)
        assert tool is not None and tool in tools.callable_tools(), f"{where}: a call of {call.name!r}"
        assert call.value is not None, f"{where}: arguments {call.arguments!r} are no JSON"
        jsonschema.validate(call.value, dict(tool.parameters))


def build_family(name: str, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Family:
    path = tmp_path_factory.mktemp(f"tiny-{name}-markers")
    make = make_tiny_qwen3_with_markers if name == "qwen3" else make_tiny_llama3_with_markers
    make(path, model_dir)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = marker_ids(tokenizer, QWEN3_MARKERS + LLAMA3_MARKERS)
    call_format = (HERMES if name == "qwen3" else LLAMA3).with_token_ids(ids)
    assert call_format.start_id is not None, "the call marker should be one token"
    assert detect_format(ids) == call_format, "the codec should find this family's format by token ID"
    return Family(name, path, tokenizer, call_format)


@pytest.fixture(scope="module")
def qwen3(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Family:
    return build_family("qwen3", model_dir, tmp_path_factory)


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def family(
    request: pytest.FixtureRequest, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Family:
    if request.param == "qwen3":
        return request.getfixturevalue("qwen3")
    return build_family(request.param, model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def forced(family: Family) -> Runs:
    """Every forced request of a family, in one engine run."""
    return run(engine_for(family.path), family.prompt, forced_requests(family))


def test_forced_calls_validate_over_50_seeds_and_nearly_all_stop(family: Family, forced: Runs) -> None:
    samples = [forced[(f"required-{seed}", 0)] for seed in range(NUM_SEEDS)]
    stopped = [s for s in samples if s.finish_reason is FinishReason.STOP]
    assert len(stopped) >= 45, f"{family.name}: only {len(stopped)} of {NUM_SEEDS} finished"
    for seed, sample in enumerate(samples):
        assert sample.token_ids[0] == family.call_format.start_id, "a call starts with the marker token"
        if sample.finish_reason is not FinishReason.STOP:
            continue
        calls, text = parse_calls(family, REQUIRED, sample)
        assert len(calls) == 1 and not text.strip(), f"seed {seed}: {family.text(sample)!r}"
        assert_valid(calls, REQUIRED, f"seed {seed}")
    assert len({tuple(s.token_ids) for s in samples}) > NUM_SEEDS // 2, "the seeds should differ"
    names = {parse_calls(family, REQUIRED, s)[0][0].name for s in stopped}
    assert names == {tool.name for tool in TOOLS}, "over 50 seeds both tools should be called"


def test_a_named_choice_only_calls_the_named_tool(family: Family, forced: Runs) -> None:
    """Parallel calls allowed: every call is of `set_mode`, and each validates but the last of a sample
    cut at max_tokens (its arguments stream as they come, so they end where the output does)."""
    num_calls = 0
    for seed in range(NUM_NAMED):
        sample = forced[(f"named-{seed}", 0)]
        calls, text = parse_calls(family, NAMED, sample)
        cut = sample.finish_reason is FinishReason.LENGTH  # text only for a call cut before its arguments
        opening = (family.call_format.start, family.call_format.separator)  # a marker, or llama3's `;`
        assert calls and (not text.strip() or (cut and text.startswith(opening))), text
        assert all(call.name == "set_mode" for call in calls), family.text(sample)
        complete = calls if sample.finish_reason is FinishReason.STOP else calls[:-1]
        assert_valid(complete, NAMED, f"named seed {seed}")
        num_calls += len(complete)
    assert num_calls >= NUM_NAMED


def test_forced_calls_survive_a_preemption(family: Family, forced: Runs) -> None:
    """A KV cache too small for every sample at once: requests are preempted and recomputed, and their
    grammar state gives the tokens of the run without preemption."""
    kv_mb = 2 if family.name == "qwen3" else 1  # ~2048 tokens each (Qwen3's head_dim is twice Llama's)
    engine = engine_for(family.path, kv_cache_memory_mb=kv_mb, max_model_len=256)
    requests = {k: v for k, v in forced_requests(family).items() if k.startswith("required")}
    samples = run(engine, family.prompt, requests)
    assert engine.stats().num_preemptions >= 1
    assert samples == {key: forced[key] for key in samples}


def test_decode_engine_continues_the_call_past_the_prefill_token(family: Family, forced: Runs) -> None:
    """The engine-level handoff: one engine samples the marker token under the grammar and exports the KV;
    another installs it with that token and decodes the call: the tokens of one engine doing both."""
    producer, consumer = engine_for(family.path), engine_for(family.path)
    requests = forced_requests(family)
    for seed in range(8):
        request_id = f"required-{seed}"
        skip = consumer.reserve_remote(request_id, family.prompt, requests[request_id])  # cached blocks
        first, export = prefill(producer, request_id, family.prompt, requests[request_id], skip)
        assert first.token_id == family.call_format.start_id
        consumer.install_remote(request_id, first, export)
    decoded = run(consumer, family.prompt, {})
    for seed in range(8):
        key = (f"required-{seed}", 0)
        assert [forced[key].token_ids[0], *decoded[key].token_ids] == forced[key].token_ids
        assert decoded[key].finish_reason is forced[key].finish_reason


# ---- a real prefill worker and decode worker (the Qwen3-style model) ----


@pytest.fixture(scope="module")
def pair(qwen3: Family, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    stack = PDPair(qwen3.path, tmp_path_factory.mktemp("pd-tool-logs"))
    yield stack
    stack.stop()


def test_a_forced_call_crosses_the_prefill_to_decode_handoff(pair: PDPair, qwen3: Family) -> None:
    """P samples the `<tool_call>` token; D advances its own matcher past it and writes the call: the
    tokens D computes alone, and a call that validates."""
    grammar = qwen3.call_format.grammar(REQUIRED)
    for seed in range(4):
        params = sampled(seed, grammar)
        got, last = pair.generate(f"remote-{seed}", qwen3.prompt, params, remote=True)
        assert last.prefill_mode == pb.PREFILL_MODE_REMOTE, f"seed {seed}: fell back or ran locally"
        assert last.finish_reason == pb.FINISH_REASON_STOP
        assert got[0] == qwen3.call_format.start_id
        calls, _ = parse_calls(qwen3, REQUIRED, Sample(got, FinishReason.STOP))
        assert len(calls) == 1
        assert_valid(calls, REQUIRED, f"seed {seed}")
        want, _ = pair.generate(f"local-{seed}", qwen3.prompt, params, remote=False)
        assert got == want, f"seed {seed}: the handoff changed the tokens"
    wait_idle(pair.decode, MD)


# ---- thinking (the Qwen3-style model: `</think>` is one token) ----

NUM_THINKING = 10


@pytest.fixture(scope="module")
def thought(qwen3: Family) -> Runs:
    """Thinking then free text, and thinking then a forced call, after a prompt that opened the block."""
    prompt = [*qwen3.prompt, qwen3.tokenizer.token_to_id("<think>")]
    free, call = thinking(qwen3, None), thinking(qwen3, qwen3.call_format.grammar(REQUIRED))
    requests = {f"free-{seed}": sampled(seed, free, max_tokens=BUDGET + 8) for seed in range(NUM_THINKING)}
    requests |= {f"call-{seed}": sampled(seed, call) for seed in range(NUM_THINKING)}
    return run(engine_for(qwen3.path), prompt, requests)


def split_reasoning(family: Family, sample: Sample) -> tuple[str, str]:
    """The reasoning and the answer, the text fed to ReasoningParser one token at a time."""
    parser = ReasoningParser(opened=True)
    pieces = [p for text in text_pieces(family.tokenizer, sample.token_ids) for p in parser.push(text)]
    pieces += parser.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningPiece))
    answer = "".join(p.text for p in pieces if isinstance(p, AnswerPiece))
    return reasoning, answer


def tokens_before(family: Family, sample: Sample, marker: str) -> int:
    """How many of the sample's tokens lie wholly before the first `marker` in its text."""
    at = family.text(sample).index(marker)
    count = 0
    while len(decode_keeping_markers(family.tokenizer, sample.token_ids[: count + 1])) <= at:
        count += 1
    return count


@pytest.mark.parametrize("kind", ["free", "call"])
def test_thinking_ends_within_its_budget_apart_from_the_answer(
    qwen3: Family, thought: Runs, kind: str
) -> None:
    """At most BUDGET tokens of thinking, then one `</think>` (at the budget the only token allowed), then
    the answer: free text, or a call that validates and ends the sample."""
    for seed in range(NUM_THINKING):
        sample = thought[(f"{kind}-{seed}", 0)]
        text = qwen3.text(sample)
        assert text.count("</think>") == 1, f"{kind} seed {seed}: {sample.finish_reason} {text!r}"
        assert tokens_before(qwen3, sample, "</think>") <= BUDGET, text
        reasoning, answer = split_reasoning(qwen3, sample)
        assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning, text
        assert answer and "</think>" not in answer and text.endswith(answer), f"{kind} seed {seed}: {text!r}"
        if kind == "call":
            assert sample.finish_reason is FinishReason.STOP, f"seed {seed}: {text!r}"
            calls, around = _parse(qwen3.call_format, REQUIRED, [answer])
            assert len(calls) == 1 and not around.strip(), answer
            assert_valid(calls, REQUIRED, f"thinking seed {seed}")
