"""Structured output through the engine, on a tiny random-weight Llama that spells with SmolLM2's tokenizer:
its unconstrained output is noise, so whatever JSON comes out is the grammar's doing.

Every constrained request runs in one engine (50 seeds per schema, temperature 1), the same seeds without
the grammar in another. Then the same grammars across a preemption, with overlapped steps, and across the
engine-level prefill -> decode handoff. The model's vocabulary is padded past the tokenizer's (49216 rows
for 49152 tokens), with padded embedding rows large enough that noise picks them often: the grammar's mask
must cover them too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from tokenizers import Tokenizer

from services.common.grammar import GrammarError, GrammarKind, GrammarSpec
from services.common.outputs import FinishReason
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_helpers import make_engine
from tests.grammar_helpers import SMOLLM2_EOS, SMOLLM2_VOCAB_SIZE, decode, make_tiny_smollm2_vocab_llama
from tests.tiny_model import make_tiny_llama
from tests.unit.test_engine_remote_kv import prefill

pytestmark = pytest.mark.model  # SmolLM2's tokenizer files come from the prepared model directory

PADDED_VOCAB_SIZE = SMOLLM2_VOCAB_SIZE + 64
NUM_SEEDS = 50
MAX_TOKENS = 96
SCHEMAS: dict[str, dict[str, Any]] = {
    # bounded strings and arrays, an integer range, an enum, optional fields
    "profile": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "active": {"type": "boolean"},
        },
        "required": ["name", "age", "role"],
        "additionalProperties": False,
    },
    # nesting: an object and an array of objects with a patterned string
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "customer": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 8}, "vip": {"type": "boolean"}},
                "required": ["name"],
                "additionalProperties": False,
            },
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "customer", "items"],
        "additionalProperties": False,
    },
    # a recursive $ref
    "tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "label": {"type": "string", "maxLength": 6},
                    "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}},
                },
                "required": ["label"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    },
}
REGEX = r"[a-z]{2,6}-[0-9]{3}"
CHOICES = ["yes", "no", "maybe"]
AB_REGEX = "[ab]{1,6}"


@dataclass
class Sample:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None


Runs = dict[tuple[str, int], Sample]


def sampled(seed: int, grammar: GrammarSpec | None, **extra: Any) -> SamplingParams:
    settings: dict[str, Any] = {"max_tokens": MAX_TOKENS, **extra}
    return SamplingParams(temperature=1.0, seed=seed, grammar=grammar, **settings)


def schema_requests() -> dict[str, SamplingParams]:
    return {
        f"{name}-{seed}": sampled(seed, GrammarSpec.json_schema(schema))
        for name, schema in SCHEMAS.items()
        for seed in range(NUM_SEEDS)
    }


def other_requests() -> dict[str, SamplingParams]:
    """Regex, choice, n=2, ignore_eos, min_tokens and a max_tokens inside the grammar."""
    regex, choice = GrammarSpec(GrammarKind.REGEX, REGEX), GrammarSpec.choice(CHOICES)
    ab = GrammarSpec(GrammarKind.REGEX, AB_REGEX)
    requests = {f"regex-{seed}": sampled(seed, regex) for seed in range(10)}
    requests |= {f"choice-{seed}": sampled(seed, choice) for seed in range(10)}
    requests |= {f"ab-{seed}": sampled(seed, ab) for seed in range(10)}
    requests |= {f"ab-ignore-eos-{seed}": sampled(seed, ab, ignore_eos=True) for seed in range(10)}
    requests |= {f"choice-min-tokens-{seed}": sampled(seed, choice, min_tokens=5) for seed in range(5)}
    requests["pair"] = sampled(7, GrammarSpec.json_schema(SCHEMAS["profile"]), n=2)
    requests["short"] = sampled(3, GrammarSpec.json_schema(SCHEMAS["order"]), max_tokens=4)
    return requests


def engine_for(tiny_dir: Path, **engine: Any) -> EngineCore:
    settings: dict[str, Any] = {"kv_cache_memory_mb": 24, **engine}
    return make_engine(tiny_dir, "float32", batch_size_limit=256, **settings)


def run(
    engine: EngineCore,
    prompt: list[int],
    requests: Mapping[str, SamplingParams],
    give_up: Callable[[str, Sample], bool] | None = None,
) -> Runs:
    """Every sample's tokens and finish. `give_up(request_id, sample)` true aborts an unfinished sample."""
    for request_id, params in requests.items():
        engine.add_request(request_id, prompt, params)
    samples: Runs = {}
    while engine.has_work():
        for out in engine.step():
            sample = samples.setdefault((out.request_id, out.index), Sample())
            sample.token_ids.extend(out.new_token_ids)
            sample.finish_reason = out.finish_reason
            if out.finish_reason is None and give_up is not None and give_up(out.request_id, sample):
                engine.abort([out.request_id])
                sample.finish_reason = FinishReason.ABORT
        engine.check_invariants()
    return samples


def text(tokenizer: Tokenizer, sample: Sample) -> str:
    return decode(tokenizer, [t for t in sample.token_ids if t < SMOLLM2_VOCAB_SIZE])


def is_valid(tokenizer: Tokenizer, sample: Sample, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(text(tokenizer, sample)), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


@pytest.fixture(scope="module")
def tiny_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-smollm2-vocab")
    return make_tiny_smollm2_vocab_llama(path, model_dir, padded_boost=3.0, vocab_size=PADDED_VOCAB_SIZE)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def prompt(tokenizer: Tokenizer) -> list[int]:
    return list(tokenizer.encode("Answer in JSON:").ids)


@pytest.fixture(scope="module")
def constrained(tiny_dir: Path, prompt: list[int]) -> Runs:
    """Every grammar request of this module's checks, in one engine run."""
    return run(engine_for(tiny_dir), prompt, schema_requests() | other_requests())


@pytest.fixture(scope="module")
def unconstrained(tiny_dir: Path, tokenizer: Tokenizer, prompt: list[int]) -> Runs:
    """The schema requests without their grammar, and 10 short `noise-*` ones. A schema sample whose text
    does not start with "{" can never be one of these objects, so it is aborted there (finish ABORT)
    rather than run to max_tokens."""
    requests = {request_id: replace(p, grammar=None) for request_id, p in schema_requests().items()}
    requests |= {f"noise-{seed}": sampled(seed, None, max_tokens=16) for seed in range(10)}

    def cannot_be_an_object(request_id: str, sample: Sample) -> bool:
        started = text(tokenizer, sample).lstrip()
        return not request_id.startswith("noise") and bool(started) and not started.startswith("{")

    return run(engine_for(tiny_dir), prompt, requests, cannot_be_an_object)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_seed_that_stops_validates_and_nearly_all_stop(
    constrained: Runs, tokenizer: Tokenizer, name: str
) -> None:
    samples = [constrained[(f"{name}-{seed}", 0)] for seed in range(NUM_SEEDS)]
    stopped = [s for s in samples if s.finish_reason is FinishReason.STOP]
    assert len(stopped) >= 0.95 * NUM_SEEDS, f"{name}: only {len(stopped)} of {NUM_SEEDS} finished"
    invalid = [text(tokenizer, s) for s in stopped if not is_valid(tokenizer, s, SCHEMAS[name])]
    assert not invalid, f"{name}: {len(invalid)} stopped samples do not validate, e.g. {invalid[0]!r}"
    assert len({tuple(s.token_ids) for s in samples}) > NUM_SEEDS // 2, "the seeds should differ"


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_the_same_seeds_without_the_grammar_do_not_validate(
    unconstrained: Runs, tokenizer: Tokenizer, name: str
) -> None:
    samples = [unconstrained[(f"{name}-{seed}", 0)] for seed in range(NUM_SEEDS)]
    valid = [text(tokenizer, s) for s in samples if is_valid(tokenizer, s, SCHEMAS[name])]
    assert not valid, f"{name}: noise validated: {valid}"


def test_padded_vocabulary_columns_are_masked(constrained: Runs, unconstrained: Runs) -> None:
    def padded(runs: Runs) -> int:
        return sum(t >= SMOLLM2_VOCAB_SIZE for s in runs.values() for t in s.token_ids)

    assert padded(unconstrained) > 0, "the noise never reached the padded rows: nothing was tested"
    assert padded(constrained) == 0


def test_regex_and_choice_outputs_match(constrained: Runs, tokenizer: Tokenizer) -> None:
    for seed in range(10):
        regex, choice = constrained[(f"regex-{seed}", 0)], constrained[(f"choice-{seed}", 0)]
        assert regex.finish_reason is FinishReason.STOP and choice.finish_reason is FinishReason.STOP
        assert re.fullmatch(REGEX, text(tokenizer, regex)), text(tokenizer, regex)
        assert text(tokenizer, choice) in CHOICES


def test_each_of_n_samples_follows_its_own_matcher(constrained: Runs, tokenizer: Tokenizer) -> None:
    first, second = constrained[("pair", 0)], constrained[("pair", 1)]
    assert first.token_ids != second.token_ids
    for sample in (first, second):
        assert sample.finish_reason is FinishReason.STOP
        assert is_valid(tokenizer, sample, SCHEMAS["profile"])


def test_a_complete_grammar_stops_without_sampling_eos(constrained: Runs) -> None:
    """JSON objects and choices end at their last character: the grammar allows nothing else."""
    for (request_id, _), sample in constrained.items():
        if request_id.startswith(("profile", "order", "tree", "choice", "regex")):
            assert SMOLLM2_EOS not in sample.token_ids, request_id


def test_eos_ends_an_accepting_grammar_unless_ignore_eos(constrained: Runs, tokenizer: Tokenizer) -> None:
    """`[ab]{1,6}` accepts from one character on: EOS may end it early; under ignore_eos EOS stays
    banned while the grammar allows more, so each sample runs to the grammar's end, six characters."""
    early = [constrained[(f"ab-{seed}", 0)] for seed in range(10)]
    assert all(s.finish_reason is FinishReason.STOP for s in early)
    assert all(re.fullmatch(AB_REGEX, text(tokenizer, s)) for s in early)
    assert any(s.token_ids[-1] == SMOLLM2_EOS for s in early), "no sample took the EOS: nothing tested"
    for seed in range(10):
        sample = constrained[(f"ab-ignore-eos-{seed}", 0)]
        assert sample.finish_reason is FinishReason.STOP
        assert SMOLLM2_EOS not in sample.token_ids
        assert re.fullmatch("[ab]{6}", text(tokenizer, sample)), text(tokenizer, sample)


def test_a_grammar_that_completes_below_min_tokens_still_stops(
    constrained: Runs, tokenizer: Tokenizer
) -> None:
    for seed in range(5):
        sample = constrained[(f"choice-min-tokens-{seed}", 0)]
        assert sample.finish_reason is FinishReason.STOP
        assert text(tokenizer, sample) in CHOICES


def test_max_tokens_inside_the_grammar_is_length(constrained: Runs, tokenizer: Tokenizer) -> None:
    sample = constrained[("short", 0)]
    assert sample.finish_reason is FinishReason.LENGTH and len(sample.token_ids) == 4
    assert not is_valid(tokenizer, sample, SCHEMAS["order"])


def test_grammars_survive_a_preemption(tiny_dir: Path, prompt: list[int], constrained: Runs) -> None:
    """A KV cache too small for every sample at once: requests are preempted and recomputed, and the
    grammar state they keep gives the tokens of the run without preemption."""
    engine = engine_for(tiny_dir, kv_cache_memory_mb=1, max_model_len=256)
    requests = {k: v for k, v in schema_requests().items() if k.startswith("order")}
    samples = run(engine, prompt, requests)
    assert engine.stats().num_preemptions >= 1
    assert samples == {key: constrained[key] for key in samples}


def test_overlapped_steps_wait_for_grammar_rows(tiny_dir: Path, prompt: list[int], constrained: Runs) -> None:
    """With `engine.overlap` (the GPU default, forced here on a CPU) a grammar row's next mask needs its
    last token, so its step is read back first; rows without a grammar in the batch overlap as usual."""
    requests = {f"tree-{seed}": schema_requests()[f"tree-{seed}"] for seed in range(6)}
    requests |= {f"plain-{seed}": sampled(seed, None, max_tokens=24) for seed in range(4)}
    overlapped = run(engine_for(tiny_dir, overlap=True), prompt, requests)
    plain = run(engine_for(tiny_dir, overlap=False), prompt, requests)
    assert overlapped == plain
    assert all(overlapped[(f"tree-{seed}", 0)] == constrained[(f"tree-{seed}", 0)] for seed in range(6))


def test_decode_engine_advances_the_grammar_past_the_prefill_token(
    tiny_dir: Path, prompt: list[int], constrained: Runs
) -> None:
    """The engine-level handoff: one engine samples the first token under the grammar and exports the KV;
    another reserves, installs it with that token, and decodes: the tokens of one engine doing both."""
    producer, consumer = engine_for(tiny_dir), engine_for(tiny_dir)
    for seed in range(8):
        request_id = f"order-{seed}"
        params = schema_requests()[request_id]
        assert consumer.reserve_remote(request_id, prompt, params) == 0
        first, export = prefill(producer, request_id, prompt, params, 0)
        consumer.install_remote(request_id, first, export)
    decoded = run(consumer, prompt, {})
    for seed in range(8):
        key = (f"order-{seed}", 0)
        assert [constrained[key].token_ids[0], *decoded[key].token_ids] == constrained[key].token_ids
        assert decoded[key].finish_reason is FinishReason.STOP


def test_a_grammar_that_does_not_compile_is_refused_before_anything_is_queued(tiny_dir: Path) -> None:
    engine = engine_for(tiny_dir)
    bad = SamplingParams(grammar=GrammarSpec(GrammarKind.REGEX, "[a-"))
    with pytest.raises(GrammarError):
        engine.add_request("bad", [1, 2, 3], bad)
    assert not engine.has_work() and engine.stats().num_waiting == 0


def test_an_engine_whose_tokenizer_llguidance_cannot_read_refuses_grammars(
    tmp_path: Path,
) -> None:
    engine = make_engine(make_tiny_llama(tmp_path / "word-level"), "float32")  # a word-level tokenizer
    assert engine.prepare_grammars() is not None
    with pytest.raises(GrammarError, match="not available"):
        engine.add_request("r", [1, 2, 3], SamplingParams(grammar=GrammarSpec.choice(["a"])))
    assert not engine.has_work()
