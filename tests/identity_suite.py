"""The identity suite of engine.deterministic (docs/deterministic.md): a fixed set of greedy and seeded
sampled requests answered under seven conditions, each answer compared bitwise (token IDs, their
logprobs and top logprobs) with the requests answered alone.

(a) alone, one request at a time, from an empty pool; (b) among 31 other requests of random
lengths (batches of 32); (c) again on the same engine, their prefixes now cached; (d) in a KV pool so
small that they are preempted and recomputed; (e) with another chunked-prefill size; (f) prefilled on
one engine and decoded on another (the P/D handoff's KV copy, as between replicas); (g) on a fresh engine
whose prompt prefixes come from the shared (Redis) tier another engine wrote.

Used by tests/integration/test_deterministic_identity.py (the mode: every condition identical) and by
scripts/identity_report.py (the same suite with and without the mode: where outputs may differ).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.outputs import TokenLogprob
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore
from services.engine.loading.factory import build_core_from_loaded, load_for
from services.engine.loading.loader import LoadedModel
from tests.engine_helpers import drain, engine_config

NUM_TOKENS = 8
SEGMENT = 32  # the shared tier's segment, so the tracked prompts span a few
CONDITIONS = ("alone", "crowd", "prefix_hit", "preempted", "chunked", "disaggregated", "shared_tier")

# One answer: (token ID, logprob, top logprobs) per generated token, compared bitwise.
Answer = list[tuple[int, float, tuple[tuple[int, float], ...]]]


@dataclass(frozen=True)
class Tracked:
    name: str
    prompt: list[int]
    params: SamplingParams


def tracked_requests(vocab: int = 49152) -> list[Tracked]:
    """Two greedy requests and two seeded sampled ones, short and across several KV blocks."""
    rng = random.Random(50)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def sampled(seed: int, **extra: Any) -> SamplingParams:
        return SamplingParams(
            temperature=0.9, seed=seed, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2, **extra
        )

    greedy = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=2)
    return [
        Tracked("greedy-long", prompt(150), greedy),
        Tracked("greedy-short", prompt(7), greedy),
        Tracked("seeded-top-p", prompt(90), sampled(1234, top_p=0.9)),
        Tracked("seeded-top-k", prompt(40), sampled(99, top_k=20)),
    ]


def answers(outputs: list[Any]) -> dict[str, Answer]:
    got: dict[str, Answer] = {}
    for out in outputs:
        got.setdefault(out.request_id, []).extend(_entries(out.new_token_ids, out.logprobs))
    return got


def _entries(token_ids: list[int], logprobs: list[TokenLogprob] | None) -> Answer:
    assert logprobs is not None and len(logprobs) == len(token_ids)
    return [
        (t, lp.logprob, tuple(tuple(top) for top in lp.top))
        for t, lp in zip(token_ids, logprobs, strict=True)
    ]


def run(engine: EngineCore, requests: list[Tracked], tag: str, salt: bytes = b"") -> dict[str, Answer]:
    for r in requests:
        engine.add_request(f"{tag}/{r.name}", r.prompt, r.params, cache_salt=salt)
    got = answers(drain(engine))
    return {r.name: got[f"{tag}/{r.name}"] for r in requests}


def others(count: int, seed: int, max_tokens: int = NUM_TOKENS) -> list[Tracked]:
    """`count` requests of random lengths (5 to 80 prompt tokens), greedy and sampled."""
    rng = random.Random(seed)
    made = []
    for i in range(count):
        prompt = [rng.randrange(100, 49152) for _ in range(rng.randrange(5, 80))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7]), max_tokens=rng.randrange(2, max_tokens + 1), ignore_eos=True,
            logprobs=2,
        )  # fmt: skip
        made.append(Tracked(f"other-{i}", prompt, params))
    return made


@dataclass
class Suite:
    """Builds engines over one model and weight format, `deterministic` or not, and answers the tracked
    requests under each condition."""

    model_dir: Path
    weights: str
    deterministic: bool
    redis_url: str
    salt: bytes  # fresh per run, so (g) reads only what this run wrote
    tracked: list[Tracked]

    loaded: LoadedModel | None = None  # the model, loaded once for every engine of the suite

    def engine(self, kv_tiers: dict[str, Any] | None = None, **engine: Any) -> EngineCore:
        """An engine with these settings over the suite's one loaded model (engines share its weights;
        each has its own KV pool)."""
        settings = {"deterministic": self.deterministic, **engine}
        config = engine_config(self.model_dir, "auto", self.weights, kv_tiers, **settings)
        if self.loaded is None:
            self.loaded = load_for(config)
        return build_core_from_loaded(self.loaded, config)

    def alone(self) -> dict[str, Answer]:
        engine = self.engine(enable_prefix_caching=False)
        got: dict[str, Answer] = {}
        for r in self.tracked:
            got.update(run(engine, [r], "alone"))
        return got

    def crowd(self) -> dict[str, Answer]:
        engine = self.engine(enable_prefix_caching=False)
        mixed = others(31, seed=7)
        for i, r in enumerate(self.tracked):
            mixed.insert(i * 7 + 3, r)  # spread among the others, so they share steps with them
        got = run(engine, mixed, "crowd")
        return {r.name: got[r.name] for r in self.tracked}

    def prefix_hit(self) -> dict[str, Answer]:
        engine = self.engine()
        run(engine, self.tracked, "first")
        before = engine.stats().prefix_cache_hits
        got = run(engine, self.tracked, "again")
        assert engine.stats().prefix_cache_hits > before, "the second pass found no cached prefix"
        return got

    def preempted(self) -> dict[str, Answer]:
        """In a pool of 14 blocks: the tracked requests are admitted first at a lower priority, then others
        arrive with long outputs; when the pool runs out, the lowest-priority running request is preempted
        (recompute), so a tracked one is."""
        self.engine()  # loads the model, so its KV dtype is known
        assert self.loaded is not None
        pool_mb = 10 if self.loaded.model.kv_dtype.itemsize == 4 else 5  # 14 blocks of fp32 or fp16 KV
        engine = self.engine(kv_cache_memory_mb=pool_mb, max_model_len=192, enable_prefix_caching=False)
        for r in self.tracked:
            engine.add_request(f"tight/{r.name}", r.prompt, r.params, priority=1)
        outputs = engine.step()
        for r in others(12, seed=11, max_tokens=48):
            engine.add_request(f"tight/{r.name}", r.prompt, r.params)
        preempted: set[str] = set()
        while engine.has_work():
            outputs.extend(engine.step())
            live = engine.scheduler.requests.values()
            preempted |= {req.parent_id for req in live if req.num_preemptions}
        assert {f"tight/{r.name}" for r in self.tracked} & preempted, "no tracked request was preempted"
        got = answers(outputs)
        return {r.name: got[f"tight/{r.name}"] for r in self.tracked}

    def chunked(self) -> dict[str, Answer]:
        engine = self.engine(max_num_batched_tokens=24, enable_prefix_caching=False)
        return run(engine, self.tracked, "chunked")

    def disaggregated(self) -> dict[str, Answer]:
        producer, consumer = self.engine(), self.engine()
        got: dict[str, Answer] = {}
        for r in self.tracked:
            rid = f"pd/{r.name}"
            skip = consumer.reserve_remote(rid, r.prompt, r.params)
            producer.add_request(rid, r.prompt, r.params, export_kv_from=skip)
            (first,) = drain(producer)
            assert first.kv is not None
            consumer.install_remote(rid, first.logprobs[0], first.kv)
            got[r.name] = _entries(first.new_token_ids, first.logprobs) + answers(drain(consumer))[rid]
        return got

    def shared_tier(self) -> dict[str, Answer]:
        tiers = {"shared_url": self.redis_url, "segment_tokens": SEGMENT, "fetch_deadline_ms": 60_000}
        writer = self.engine(kv_tiers=tiers)
        run(writer, self.tracked, "write", self.salt)
        writer.close()  # its writes finish
        reader = self.engine(kv_tiers=tiers)
        for r in self.tracked:
            reader.add_request(f"read/{r.name}", r.prompt, r.params, cache_salt=self.salt)
        outputs = drain(reader)
        reader.close()
        fetched = {o.request_id: o.num_cached_tokens for o in outputs if o.finished}
        assert fetched["read/greedy-long"] >= SEGMENT, "the shared tier served no prefix"
        got = answers(outputs)
        return {r.name: got[f"read/{r.name}"] for r in self.tracked}

    def conditions(self) -> dict[str, Callable[[], dict[str, Answer]]]:
        return {name: getattr(self, name) for name in CONDITIONS}


def differing(reference: dict[str, Answer], got: dict[str, Answer]) -> list[str]:
    """The tracked requests whose answer is not bitwise the reference's."""
    return sorted(name for name in reference if got[name] != reference[name])


def how_they_differ(reference: dict[str, Answer], got: dict[str, Answer]) -> str:
    """ "identical", "logprobs" (the same tokens, other logprobs) or "tokens", over every tracked request."""
    if not differing(reference, got):
        return "identical"
    same_tokens = all([t[0] for t in got[n]] == [t[0] for t in reference[n]] for n in reference)
    return "logprobs" if same_tokens else "tokens"
