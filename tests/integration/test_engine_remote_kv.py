"""The engine-level handoff on a real model: the KV `ModelRunner.read_kv` copies out of one engine's cache
tensors, written into another's by `write_kv`, decodes the same tokens as one engine doing both, over
fp32 and over fp16 KV caches (engine.kv_cache_dtype: the copies keep the cache's dtype, never widened).

The handoff's bookkeeping (reservations, skips, resume, refusals) is tested on the fake runner in
tests/unit/test_engine_remote_kv.py; this checks the real runner's KV copies, which the fake stands in for.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.common.config import load_config
from services.common.errors import ConfigError
from services.engine.core import EngineCore
from services.engine.loading.factory import build_core_from_loaded
from services.engine.loading.loader import load_model
from tests.engine_helpers import generate, make_engine, run_to_completion
from tests.tiny_model import make_tiny_llama
from tests.unit.test_engine_remote_kv import GREEDY, PROMPTS, assert_idle, prefill


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


def engine_for(tiny_dir: Path, kv_cache_dtype: str = "auto") -> EngineCore:
    return make_engine(tiny_dir, "float32", kv_cache_memory_mb=4, kv_cache_dtype=kv_cache_dtype)


@pytest.mark.parametrize("kv", ["auto", "float16"])
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_handoff_decodes_the_same_tokens_as_one_engine(tiny_dir: Path, name: str, kv: str) -> None:
    prompt = PROMPTS[name]
    want = generate(engine_for(tiny_dir, kv), {"r": prompt}, GREEDY)["r"]
    producer, consumer = engine_for(tiny_dir, kv), engine_for(tiny_dir, kv)
    assert producer.kv_dtype == (torch.float16 if kv == "float16" else torch.float32)
    skip = consumer.reserve_remote("r", prompt, GREEDY)
    assert skip == 0
    first, export = prefill(producer, "r", prompt, GREEDY, skip)
    assert export.start_token == 0 and export.kv.shape[1] == len(prompt)
    assert export.kv.dtype == producer.kv_dtype
    assert_idle(producer)  # the prefill replica keeps nothing active (its blocks stay cached)
    consumer.install_remote("r", first, export)
    got = [first.token_id, *run_to_completion(consumer)["r"]]
    assert got == want
    assert_idle(consumer)


def test_cached_prefix_on_the_decode_side_is_not_sent_again(tiny_dir: Path) -> None:
    prompt = PROMPTS["blocks"]
    producer, consumer = engine_for(tiny_dir), engine_for(tiny_dir)
    generate(consumer, {"warm": prompt}, GREEDY)  # the decode replica now caches the prompt's blocks
    skip = consumer.reserve_remote("r", prompt, GREEDY)
    assert skip == 64
    first, export = prefill(producer, "r", prompt, GREEDY, skip)
    consumer.install_remote("r", first, export)
    want = generate(engine_for(tiny_dir), {"r": prompt}, GREEDY)["r"]
    assert [first.token_id, *run_to_completion(consumer)["r"]] == want
    assert_idle(consumer)


def test_an_fp16_cache_holds_twice_the_blocks_and_serves_its_own_fingerprint(tiny_dir: Path) -> None:
    wide, narrow = engine_for(tiny_dir), engine_for(tiny_dir, "float16")
    assert narrow.stats().kv_blocks.num_total == 2 * wide.stats().kv_blocks.num_total  # same 4 MB
    assert narrow.manifest.model_fingerprint != wide.manifest.model_fingerprint  # never paired together
    assert narrow.root_hash != wide.root_hash  # nor prefix-matched
    assert narrow.manifest.directory_fingerprint == wide.manifest.directory_fingerprint


def test_a_core_refuses_a_named_kv_dtype_its_loaded_model_does_not_hold(tiny_dir: Path) -> None:
    loaded = load_model(tiny_dir, "float32")  # auto: the C kernels' fp32 cache
    config = load_config(None, env={})
    config = config.model_copy(
        update={"engine": config.engine.model_copy(update={"kv_cache_dtype": "float16"})}
    )
    with pytest.raises(ConfigError, match="is float16, but the model was loaded with a float32"):
        build_core_from_loaded(loaded, config)
