"""A fake model runner at the engine's `Runner` seam, and an engine core built on it: no model directory.

The fake's "KV" of a position is the pair (token ID, position), stored in the slot the request's block
table maps that position to. A sampled token is a hash of the context read back from those slots (with
the seed and output position for seeded sampling, a random draw for unseeded sampling), so a wrong block
table, a prefix hit on the wrong blocks or KV installed in the wrong place changes the tokens, as it would
on a real model; reading a slot nothing wrote raises `UnwrittenKVError`. The runner records every chunk
it computed and every KV read and write, so tests can check prefix hits and block tables.
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.common.config import load_config
from services.common.manifest import Manifest
from services.common.outputs import TokenLogprob
from services.engine.core import EngineCore
from services.engine.layers.kv_cache import KVCacheSpec
from services.engine.loading.factory import assemble_core
from services.engine.model_config import ModelConfig
from services.engine.runner_protocol import PendingStep, Runner, StepResult
from services.engine.scheduling.block_pool import NO_BLOCK
from services.engine.scheduling.request import PLACEHOLDER, Request, SeqId
from services.engine.scheduling.scheduler import SchedulerOutput

# The shape of tests/tiny_model.py's tiny Llama, so KV budgets plan the same number of blocks.
FAKE_MODEL = ModelConfig(
    architecture="FakeForCausalLM",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_ids=(1,),
)
FAKE_MANIFEST = Manifest(files={}, tokenizer_fingerprint="fake-tokenizer", model_fingerprint="fake-model")
FAKE_LOGPROB = -0.5  # every token's logprob, when asked for


class UnwrittenKVError(AssertionError):
    """The fake was asked to read KV at a slot no step and no install ever wrote."""


@dataclass(frozen=True)
class Computed:
    """One chunk the fake computed: positions start..end-1 of a sequence, over these blocks."""

    seq_id: SeqId
    start: int
    end: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class KVCopy:
    """One `read_kv` or `write_kv` call: positions start..end-1 over these blocks."""

    block_ids: tuple[int, ...]
    start: int
    end: int


class FakeRunner:
    """A `Runner` with deterministic tokens and a KV cache of (token ID, position) pairs per slot."""

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, vocab_size: int, seed: int, step_seconds: float = 0.0
    ) -> None:
        self.spec = spec
        self.num_slots = num_blocks * spec.block_size
        self.vocab_size = vocab_size
        self.step_seconds = step_seconds  # a model's compute time per forward, for tests that race a step
        self.slots: dict[int, tuple[int, int]] = {}  # slot -> (token ID, position) written there
        self.computed: list[Computed] = []
        self.kv_reads: list[KVCopy] = []
        self.kv_writes: list[KVCopy] = []
        self.num_forwards = 0
        self._rng = random.Random(seed)
        self._before_forward: Callable[[], None] | None = None
        self._previous: dict[SeqId, int] = {}  # the last launch's tokens, for placeholder inputs
        # ("launch", n) and ("collect", n) in the order they happened, n counting launches from 1
        self.events: list[tuple[str, int]] = []

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.spec.dtype

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def set_before_forward(self, hook: Callable[[], None] | None) -> None:
        self._before_forward = hook

    def execute(self, step: SchedulerOutput) -> StepResult:
        return self.launch(step).collect()

    def launch(self, step: SchedulerOutput) -> PendingStep:
        """Computes the step at once; a PLACEHOLDER input takes the token the last launch sampled."""
        if self._before_forward is not None:
            self._before_forward()
        self.num_forwards += 1
        number = self.num_forwards
        self.events.append(("launch", number))
        for chunk in step.chunks:
            request, start = chunk.request, chunk.start_position
            end = start + chunk.num_new_tokens
            for position in range(start, end):
                token_id = request.token_ids[position]
                if token_id == PLACEHOLDER:
                    token_id = self._previous[request.seq_id]
                self.slots[self._slot(request.block_ids, position)] = (token_id, position)
            self.computed.append(Computed(request.seq_id, start, end, tuple(request.block_ids)))
        if self.step_seconds:
            time.sleep(self.step_seconds)
        sampled = {c.request.seq_id: self._sample(c.request) for c in step.chunks if c.samples}
        self._previous = {seq_id: token.token_id for seq_id, token in sampled.items()}
        return _FakePending(self, number, StepResult(sampled))

    def read_kv(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        self.kv_reads.append(KVCopy(tuple(block_ids), start, end))
        spec = self.spec
        kv = torch.zeros(spec.num_layers, end - start, 2, spec.num_kv_heads, spec.head_dim, dtype=spec.dtype)
        for i, position in enumerate(range(start, end)):
            token_id, stored_position = self._read(block_ids, position)
            kv[:, i, 0] = token_id  # [num_layers, num_kv_heads, head_dim]: K carries the token ID
            kv[:, i, 1] = stored_position  # V carries the position
        return kv  # [num_layers, end - start, 2, num_kv_heads, head_dim]

    def write_kv(self, block_ids: list[int], start: int, kv: torch.Tensor) -> None:
        spec = self.spec
        if kv.shape[0] != spec.num_layers or kv.shape[2:] != (2, spec.num_kv_heads, spec.head_dim):
            raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit this model's cache")
        self.kv_writes.append(KVCopy(tuple(block_ids), start, start + kv.shape[1]))
        for i in range(kv.shape[1]):
            self.slots[self._slot(block_ids, start + i)] = (int(kv[0, i, 0, 0, 0]), int(kv[0, i, 1, 0, 0]))

    def write_cross(self, request: Request, encoder_states: torch.Tensor) -> None:
        raise NotImplementedError("the fake runner serves decoder-only models")

    def take_encoder_times(self) -> list[float]:
        return []  # decoder-only: never encodes

    def computed_for(self, seq_id: SeqId) -> list[tuple[int, int]]:
        """The position ranges (start, end) computed for one sequence, in order."""
        return [(c.start, c.end) for c in self.computed if c.seq_id == seq_id]

    def _slot(self, block_ids: list[int], position: int) -> int:
        block_id = block_ids[position // self.spec.block_size]
        if not 0 <= block_id < self.num_slots // self.spec.block_size:
            raise AssertionError(f"position {position} maps to block {block_id}, not in the pool")
        return block_id * self.spec.block_size + position % self.spec.block_size

    def _read(self, block_ids: list[int], position: int) -> tuple[int, int]:
        slot = self._slot(block_ids, position)
        if slot not in self.slots:
            raise UnwrittenKVError(f"position {position} reads slot {slot}, which nothing wrote")
        return self.slots[slot]

    def _context(self, request: Request) -> list[tuple[int, int]]:
        """What attention would read for the request's next token: every position's stored KV."""
        bs = self.spec.block_size
        return [
            self._read(request.block_ids, p)
            for p in range(request.num_tokens)
            if request.block_ids[p // bs] != NO_BLOCK
        ]

    def _sample(self, request: Request) -> TokenLogprob:
        params = request.params
        key: tuple[object, ...] = (self._context(request),)
        if params.temperature > 0 and params.seed is not None:
            key += (params.seed, request.num_output_tokens)
        elif params.temperature > 0:
            key += (self._rng.random(),)
        digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
        token_id = int.from_bytes(digest, "big") % self.vocab_size
        banned = _banned(request)
        while token_id in banned:
            token_id = (token_id + 1) % self.vocab_size
        if params.logprobs is None:
            return TokenLogprob(token_id, 0.0)
        return TokenLogprob(token_id, FAKE_LOGPROB, [(token_id, FAKE_LOGPROB)][: params.logprobs])


@dataclass
class _FakePending:
    runner: FakeRunner
    number: int
    result: StepResult

    def collect(self) -> StepResult:
        self.runner.events.append(("collect", self.number))
        return self.result


def _banned(request: Request) -> set[int]:
    """EOS and stop tokens are banned until min_tokens outputs exist (as the real sampler does)."""
    if request.num_output_tokens >= request.params.min_tokens:
        return set()
    banned = set(request.params.stop_token_ids)
    if not request.params.ignore_eos:
        banned |= request.eos_token_ids
    return banned


def make_fake_engine(
    batch_size_limit: int = 32,
    *,
    step_seconds: float = 0.0,
    model: ModelConfig = FAKE_MODEL,
    **engine: Any,
) -> EngineCore:
    """An engine core over a `FakeRunner`, built like `loading.factory.build_core` with these `engine.*`
    settings (the defaults otherwise) and `limits.batch_size_limit`."""
    engine_config = load_config(None, env={}).engine.model_copy(update=engine)

    def runner_for(spec: KVCacheSpec, num_blocks: int) -> Runner:
        return FakeRunner(spec, num_blocks, model.vocab_size, engine_config.seed, step_seconds)

    return assemble_core(model, FAKE_MANIFEST, engine_config, batch_size_limit, torch.float32, runner_for)


def fake_runner(engine: EngineCore) -> FakeRunner:
    """The fake runner under a core built by `make_fake_engine`."""
    runner = engine.runner
    assert isinstance(runner, FakeRunner)
    return runner


@dataclass
class StubGpu:
    """A device's memory figures (a MemoryProbe, services/engine/loading/device.py), in bytes."""

    free: int = 8 << 30
    total: int = 80 << 30
    allocated: int = 60 << 30
    reserved: int = 64 << 30

    def mem_get_info(self) -> tuple[int, int]:
        return self.free, self.total

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.reserved

    def max_memory_allocated(self) -> int:
        return self.allocated

    def reset_peak(self) -> None:
        pass
