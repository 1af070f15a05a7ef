"""T5 served by the engine (issue 51): requests carry an encoder input; the decoder runs continuously
batched over the paged cache, each sequence's cross-attention KV in blocks of its own. Greedy tokens equal
transformers' generate (fp32) up to a near-tie, batched, chunked and across preemptions; aborts and
finishes leave no block held; bad inputs are refused with a 400's error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.engine_input import check_request
from services.common.errors import InvalidRequestError
from services.common.manifest import compute_manifest, write_manifest
from services.common.outputs import TokenLogprob
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from tests.engine_helpers import drain, make_engine
from tests.tiny_model import make_tiny_llama
from tests.tiny_t5 import make_tiny_t5

NUM_TOKENS = 20  # past one block of 16: a running sequence grows, and may be preempted
NEAR_TIE = 1e-3
GREEDY = SamplingParams(
    temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS
)  # EOS banned to the end


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path, reference = make_tiny_t5(tmp_path_factory.mktemp("t5"), gated=True, tied=False)
    write_manifest(path, compute_manifest(path))
    return path, reference


def sources(count: int, seed: int, shortest: int = 1) -> list[list[int]]:
    """`count` random byte sources of `shortest` to 90 tokens, each ending with EOS."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(shortest, 90, (count,), generator=generator).tolist()
    return [[*torch.randint(3, 259, (n,), generator=generator).tolist(), 1] for n in lengths]


def expected(reference: Any, source: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens for `source`, and each step's top-1/top-2 margin."""
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([source]), max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False,
            num_beams=1, output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, 1:].tolist(), margins


def run(engine: EngineCore, srcs: list[list[int]], tag: str) -> dict[int, list[int]]:
    for i, src in enumerate(srcs):
        engine.add_request(f"{tag}{i}", [0], GREEDY, encoder_token_ids=src)  # the decoder starts at token 0
    got: dict[int, list[int]] = {}
    for out in drain(engine):
        got.setdefault(int(out.request_id.removeprefix(tag)), []).extend(out.new_token_ids)
    assert engine.stats().kv_blocks.num_active == 0
    return got


def assert_matches(reference: Any, srcs: list[list[int]], got: dict[int, list[int]]) -> None:
    compared = total = 0
    for i, src in enumerate(srcs):
        want, margins = expected(reference, src)
        assert len(got[i]) == NUM_TOKENS
        total += NUM_TOKENS
        for step, (a, b) in enumerate(zip(got[i], want, strict=True)):
            if a != b:
                assert margins[step] < NEAR_TIE, f"source {i} diverged at step {step}"
                break
            compared += 1
    assert compared >= 0.8 * total


def test_batched_greedy_matches_transformers(tiny: tuple[Path, Any]) -> None:
    path, reference = tiny
    engine = make_engine(path, "float32", max_num_batched_tokens=16)  # several steps per batch of rows
    srcs = sources(6, seed=1)
    assert_matches(reference, srcs, run(engine, srcs, "b"))


def test_decoder_prefixes_are_shared_only_under_the_same_encoder_input(tiny: tuple[Path, Any]) -> None:
    """Every decoder starts from the same token: its block hashes carry a digest of the encoder input, so
    a decoder prompt is a prefix-cache hit under its own source and never under another."""
    path, _ = tiny
    engine = make_engine(path, "float32")
    first, second = sources(2, seed=5)
    decoder_prompt = [0, *range(40, 60)]  # 21 tokens: one whole block of 16
    outputs = {}
    for name, src in (("a", first), ("again", first), ("other", second)):
        before = engine.stats().prefix_cache_hits
        engine.add_request(name, decoder_prompt, GREEDY, encoder_token_ids=src)
        outputs[name] = [t for out in drain(engine) for t in out.new_token_ids]
        outputs[name + "-hits"] = engine.stats().prefix_cache_hits - before
    assert (outputs["a-hits"], outputs["again-hits"], outputs["other-hits"]) == (0, 16, 0)
    assert outputs["again"] == outputs["a"]  # the cached prefix gives the same tokens


def test_preempted_sequences_re_encode_and_match(tiny: tuple[Path, Any]) -> None:
    path, reference = tiny
    # 1 MiB holds 170 blocks of 16 tokens here; 30 sequences of 5 or 6 cross and 2 self blocks need more
    engine = make_engine(path, "float32", kv_cache_memory_mb=1, max_model_len=96, enable_prefix_caching=False)
    srcs = sources(30, seed=2, shortest=70)
    got = run(engine, srcs, "p")
    assert engine.stats().num_preemptions >= 1
    assert_matches(reference, srcs, got)


def test_the_split_ships_encoder_states_and_decode_matches(tiny: tuple[Path, Any]) -> None:
    """P/D in one process: the prefill engine encodes and samples the first token, its export carries the
    encoder output; the decode engine (a pool small enough to preempt, so some sequences re-encode there)
    builds the cross KV from it, decodes, and matches transformers. Sources of 1 to 200 tokens, batched."""
    path, reference = tiny
    prefill = make_engine(path, "float32")
    decode = make_engine(
        path, "float32", kv_cache_memory_mb=1, max_model_len=224, enable_prefix_caching=False
    )
    srcs = [*sources(24, seed=4, shortest=60), [*range(3, 203), 1]]  # and a long source: 200 bytes and EOS
    for i, src in enumerate(srcs):
        prefill.add_request(f"d{i}", [0], GREEDY, encoder_token_ids=src, export_kv_from=0)
    exports = {out.request_id: out for out in drain(prefill)}
    assert prefill.stats().kv_blocks.num_active == 0
    for i, src in enumerate(srcs):
        out = exports[f"d{i}"]
        assert out.kv is not None and out.kv.encoder_states is not None
        assert tuple(out.kv.encoder_states.shape) == (len(src), 32)  # d_model, not the cross KV
        engine_input = check_request(f"d{i}", [0], GREEDY, 259, encoder_token_ids=src)
        if decode.reserve(engine_input) is None:  # no room: the decode replica computes it itself
            decode.add(engine_input)
            exports.pop(f"d{i}")
            continue
        decode.install_remote(f"d{i}", TokenLogprob(out.new_token_ids[0], 0.0), out.kv)
    assert len(exports) >= len(srcs) // 2  # most came through the split
    got = {int(rid.removeprefix("d")): [out.new_token_ids[0]] for rid, out in exports.items()}
    for out in drain(decode):
        got.setdefault(int(out.request_id.removeprefix("d")), []).extend(out.new_token_ids)
    stats = decode.stats()
    assert stats.num_preemptions >= 1  # some re-encoded here, from the source they carry
    # the installed ones were never encoded here, unless preempted: only local and readmitted ones were
    assert stats.num_encoded_sequences <= len(srcs) - len(exports) + stats.num_preemptions
    assert stats.kv_blocks.num_active == 0
    assert_matches(reference, srcs, got)


def test_a_step_admits_sources_within_its_encoder_budget(tiny: tuple[Path, Any]) -> None:
    """engine.max_num_encoder_tokens 130: sources of 60 tokens come in two a step (a third would pass it),
    and all decode alike."""
    path, _ = tiny
    engine = make_engine(path, "float32", max_num_encoder_tokens=130)
    generator = torch.Generator().manual_seed(9)
    for i in range(6):
        engine.add_request(
            f"e{i}", [0], GREEDY, encoder_token_ids=torch.randint(3, 259, (60,), generator=generator).tolist()
        )
    admitted = []
    for _ in range(3):
        engine.step()
        admitted.append(engine.stats().num_running)
    assert admitted == [2, 4, 6]
    drain(engine)
    assert engine.stats().kv_blocks.num_active == 0


def test_an_abort_frees_self_and_cross_blocks(tiny: tuple[Path, Any]) -> None:
    path, _ = tiny
    engine = make_engine(path, "float32")
    for i, src in enumerate(sources(5, seed=3)):
        engine.add_request(f"a{i}", [0], GREEDY, encoder_token_ids=src)
    engine.step()
    engine.step()
    held = engine.stats().kv_blocks.num_active
    assert held > 0
    for i in range(5):
        engine.abort_request(f"a{i}")
    engine.check_invariants()
    assert engine.stats().kv_blocks.num_active == 0


def test_inputs_an_encoder_decoder_or_a_decoder_only_model_cannot_take_are_refused(
    tiny: tuple[Path, Any], tmp_path: Path
) -> None:
    path, _ = tiny
    engine = make_engine(path, "float32", max_model_len=64)
    with pytest.raises(InvalidRequestError, match="needs a non-empty encoder input"):
        engine.add_request("empty", [0], GREEDY)
    with pytest.raises(InvalidRequestError, match="reads at most 64"):
        engine.add_request("long", [0], GREEDY, encoder_token_ids=[5] * 65)
    checked = check_request(
        "bare", [0], GREEDY, engine.vocab_size
    )  # as the worker's and async paths build it
    with pytest.raises(InvalidRequestError, match="needs a non-empty encoder input"):
        engine.add(checked)
    assert engine.stats().num_waiting == 0
    llama = make_engine(make_tiny_llama(tmp_path / "llama"), "float32")
    with pytest.raises(InvalidRequestError, match="decoder-only: it takes no encoder input"):
        llama.add_request("r", [5, 6], GREEDY, encoder_token_ids=[5])
