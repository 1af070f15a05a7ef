"""The real model and the disk tier (the factory's wiring, `kv_tiers.disk_path`): each stored segment holds
exactly the KV the engine computed for those tokens, and a fresh engine that reads them back answers with
the same greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from services.common.block_hash import hash_token_blocks
from services.common.sampling import SamplingParams
from services.engine.kv_tiers import KVTiers
from services.kvcache.disk_tier import DiskTier
from services.kvcache.segment import Namespace, decode, segment_key
from tests.engine_helpers import drain, make_engine, run_to_completion
from tests.integration.test_engine_identity import assert_matches, long_cases, submit

NUM_NEW_TOKENS = 64  # the fixture's

pytestmark = pytest.mark.model


def test_a_finished_request_is_written_through_with_its_exact_kv(model_dir: Path, tmp_path: Path) -> None:
    core = make_engine(model_dir, kv_tiers={"disk_path": str(tmp_path), "segment_tokens": 32})
    prompt = list(range(100, 170))  # 70 tokens: two whole segments of the prompt
    core.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0), cache_salt=b"tenant-a")
    run_to_completion(core)
    blocks = core.block_size
    hashes = hash_token_blocks(core.root_hash, prompt, blocks, b"tenant-a")
    namespace = Namespace(
        core.manifest.model_fingerprint, core.served.weights, "float32", "float32", blocks,
        core.model_config.num_layers, core.model_config.num_kv_heads, core.model_config.head_dim,
        segment_tokens=32,
    )  # fmt: skip
    core.close()  # lets the writer finish
    disk = DiskTier(tmp_path, 1 << 30)
    # The same prompt again, cold, in a fresh engine with no tiers: the KV each segment must hold.
    cold = make_engine(model_dir)
    held = SamplingParams(
        max_tokens=2, temperature=0.0, ignore_eos=True
    )  # still holds its blocks after a step
    cold.add_request("c", prompt, held, cache_salt=b"tenant-a")
    request = cold.scheduler.requests[next(iter(cold.scheduler.requests))]
    cold.step()  # the prefill: the prompt's KV is in the pool, the request still holds its blocks
    for start in (0, 32):
        seg_hashes = hashes[start // blocks : (start + 32) // blocks]
        value = disk.get(segment_key(namespace, b"tenant-a", seg_hashes[-1]))
        assert value is not None, f"no segment at {start}"
        payload = decode(value, namespace, b"tenant-a", start, seg_hashes)
        want = cold.runner.read_kv(request.block_ids, start, start + 32)  # [L, 32, 2, H, D]
        got = torch.frombuffer(bytearray(payload), dtype=torch.float32).view(want.shape)
        assert torch.equal(got, want)
    assert len(list(tmp_path.rglob("*.kvs"))) == 2


def test_a_restarted_worker_reads_its_prefixes_back_from_disk_with_the_same_greedy_tokens(
    model_dir: Path, tmp_path: Path
) -> None:
    """Token identity through the disk tier: the fixture's two shortest prompts past 500 tokens, answered
    by an engine that wrote them through, then by a fresh one (a restart: an empty pool, the same disk)
    that reads them back."""
    cases = long_cases(2)
    assert len(cases) == 2
    num_tokens = NUM_NEW_TOKENS
    first = make_engine(model_dir, kv_tiers={"disk_path": str(tmp_path)})
    submit(first, cases, "cold", num_tokens)
    cold = run_to_completion(first)
    first.close()
    second = make_engine(model_dir, kv_tiers={"disk_path": str(tmp_path)})
    submit(second, cases, "warm", num_tokens)
    outputs = drain(second)
    warm: dict[str, list[int]] = {}
    for output in outputs:
        warm.setdefault(output.request_id, []).extend(output.new_token_ids)
    for case in cases:
        assert_matches(case, cold[f"cold/{case['name']}"])
        assert_matches(case, warm[f"warm/{case['name']}"])
    cached = {o.request_id: o.num_cached_tokens for o in outputs if o.finish_reason is not None}
    assert all(cached[f"warm/{c['name']}"] >= 256 for c in cases), cached  # at least a segment each
    second.close()


def test_the_host_tier_gives_a_prefix_back_after_the_pool_lost_it_with_the_same_greedy_tokens(
    model_dir: Path,
) -> None:
    """Token identity through the host tier: the fixture's shortest prompt past 500 tokens, written through
    to the worker's memory, the pool's prefix cache dropped, the prompt again: loaded, not recomputed."""
    (case,) = long_cases(1)
    core = make_engine(model_dir, kv_tiers={"host_capacity_mb": 256, "segment_tokens": 64})
    answers = {}
    for turn in ("cold", "from-host"):
        assert core.reset_prefix_cache()
        submit(core, [case], turn, NUM_NEW_TOKENS)
        outputs = drain(core)
        answers[turn] = ([t for o in outputs for t in o.new_token_ids], outputs[-1].num_cached_tokens)
        assert cast(KVTiers, core.tiers).writes.writer.wait_idle(30)
    assert_matches(case, answers["cold"][0])
    assert_matches(case, answers["from-host"][0])
    assert answers["cold"][1] == 0
    assert answers["from-host"][1] == (len(case["prompt_token_ids"]) - 1) // 64 * 64
    core.close()
