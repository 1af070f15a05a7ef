"""Building an engine core for tests, and running it to completion with invariant checks."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

import torch

from services.common.config import KvrelayConfig, load_config
from services.common.outputs import TokenLogprob
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore, RequestOutput
from services.engine.loading.factory import build_core


def make_engine(
    model_dir: Path,
    dtype: str = "float32",
    batch_size_limit: int = 32,
    weights: str = "safetensors",
    kv_tiers: dict[str, Any] | None = None,
    **engine: Any,
) -> EngineCore:
    """An engine over `model_dir`; `weights` (model.weights) is explicit so a test never changes path when
    the default `auto` does. `kv_tiers`: settings of the KV tiers below its pool (none by default)."""
    return build_core(engine_config(model_dir, dtype, weights, kv_tiers, batch_size_limit, **engine))


def engine_config(
    model_dir: Path,
    dtype: str = "float32",
    weights: str = "safetensors",
    kv_tiers: dict[str, Any] | None = None,
    batch_size_limit: int = 32,
    **engine: Any,
) -> KvrelayConfig:
    """make_engine's configuration."""
    cfg = load_config(None, env={})
    model = {"path": str(model_dir), "dtype": dtype, "weights": weights}
    cfg = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(update=model),
            "engine": cfg.engine.model_copy(update=engine),
            "limits": cfg.limits.model_copy(update={"batch_size_limit": batch_size_limit}),
            "kv_tiers": cfg.kv_tiers.model_copy(update=kv_tiers or {}),
        }
    )
    return cfg


def drain(engine: EngineCore, check_invariants: bool = True) -> list[RequestOutput]:
    """Step until idle, checking the block pool's invariants after each step; every output, in order."""
    outputs: list[RequestOutput] = []
    while engine.has_work():
        outputs.extend(engine.step())
        if check_invariants:
            engine.check_invariants()
    return outputs


def run_samples(engine: EngineCore, check_invariants: bool = True) -> dict[tuple[str, int], list[int]]:
    """Step until idle; return output token IDs keyed by (request ID, sample index)."""
    outputs: dict[tuple[str, int], list[int]] = {}
    for out in drain(engine, check_invariants):
        outputs.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
    return outputs


def run_to_completion(engine: EngineCore, check_invariants: bool = True) -> dict[str, list[int]]:
    """Step until idle; return output token IDs keyed by request ID (requests of one sample each)."""
    samples = run_samples(engine, check_invariants)
    assert all(index == 0 for _, index in samples), "requests with n > 1: use run_samples"
    return {request_id: tokens for (request_id, _), tokens in samples.items()}


def generate(
    engine: EngineCore, prompts: dict[str, Sequence[int]], params: SamplingParams
) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return run_to_completion(engine)


# -- comparing greedy output against an fp32 reference, by logprobs ------------------------------------


def run_with_logprobs(engine: EngineCore) -> dict[str, list[TokenLogprob]]:
    """Step until idle; each request's chosen tokens with their logprobs (requests must ask for them)."""
    outputs: dict[str, list[TokenLogprob]] = {}
    while engine.has_work():
        for out in engine.step():
            assert out.logprobs is not None, f"{out.request_id} was not asked for logprobs"
            outputs.setdefault(out.request_id, []).extend(out.logprobs)
        engine.check_invariants()
    return outputs


def teacher_forced_logprobs(hf_model: Any, prompt: Sequence[int], generated: Sequence[int]) -> torch.Tensor:
    """A transformers causal LM's log-softmax at each generated position, given the prompt and the tokens
    generated before it: one forward over prompt + generated. Row i is the distribution that chose
    `generated[i]`. Returns [len(generated), vocab] in float32."""
    ids = torch.tensor([[*prompt, *generated]])  # [1, prompt + generated]
    with torch.inference_mode():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1]  # [len(generated), vocab]
    return logits.float().log_softmax(dim=-1)


def assert_follows_reference(
    name: str,
    got: Sequence[TokenLogprob],
    reference: torch.Tensor,
    *,
    near_tie: float,
    logprob_atol: float,
    min_prefix: int = 0,
    banned_token_ids: Collection[int] = (),
) -> int:
    """Greedy tokens with their top-k logprobs against a reference's log-softmax along the same tokens
    (`teacher_forced_logprobs`); returns how many positions picked another token than the reference.

    vLLM's `check_logprobs_close`, made stronger by teacher forcing: the reference is read along the
    engine's own tokens, so every position is compared, not only those before the first divergence.
    At each position the engine's token is the reference's argmax (over tokens not in
    `banned_token_ids`, e.g. EOS under `min_tokens`), or a near-tie there: the reference ranks it at most
    `near_tie` nats below its argmax, and the argmax is in the engine's top k. The first `min_prefix`
    tokens must be the reference's. Every logprob the engine returned (its token and its top k) is
    within `logprob_atol` nats of the reference's for the same token.
    """
    allowed = reference.clone()  # [num_tokens, vocab]
    allowed[:, list(banned_token_ids)] = float("-inf")
    num_flips = 0
    for i, chosen in enumerate(got):
        where = f"{name}: token {i}"
        want = int(allowed[i].argmax())
        if chosen.token_id != want:
            num_flips += 1
            gap = float(reference[i, want] - reference[i, chosen.token_id])
            assert i >= min_prefix, f"{where} is {chosen.token_id}, the reference's is {want}"
            assert gap <= near_tie, f"{where}: the reference ranks {chosen.token_id} {gap:.3f} below {want}"
            top_ids = [token_id for token_id, _ in chosen.top]
            assert want in top_ids, f"{where}: the reference's {want} is not in the top {top_ids}"
        for token_id, logprob in [(chosen.token_id, chosen.logprob), *chosen.top]:
            diff = abs(logprob - float(reference[i, token_id]))
            assert diff <= logprob_atol, f"{where}: logprob of {token_id} off by {diff:.3f} nats"
    return num_flips


def count_unpacking(monkeypatch: Any) -> dict[str, int]:
    """Counts every call of the C kernels' block unpacking (`CpuKernels.dequantize`) from now on, under
    "calls"; the calls still unpack."""
    from services.engine.ops.cpu import CpuKernels

    counter = {"calls": 0}
    unpack = CpuKernels.dequantize

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        counter["calls"] += 1
        return unpack(*args, **kwargs)

    monkeypatch.setattr(CpuKernels, "dequantize", counted)
    return counter
