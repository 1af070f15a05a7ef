"""Building an engine core for tests, and running it to completion with invariant checks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.config import load_config
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore


def make_engine(
    model_dir: Path, dtype: str = "float32", batch_size_limit: int = 32, **engine: Any
) -> EngineCore:
    cfg = load_config(None, env={})
    cfg = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(update={"path": str(model_dir), "dtype": dtype}),
            "engine": cfg.engine.model_copy(update=engine),
            "limits": cfg.limits.model_copy(update={"batch_size_limit": batch_size_limit}),
        }
    )
    return EngineCore.from_config(cfg)


def run_to_completion(engine: EngineCore, check_invariants: bool = True) -> dict[str, list[int]]:
    """Step until idle; return output token IDs keyed by request ID (`id#i` for samples i > 0)."""
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            key = out.request_id if out.index == 0 else f"{out.request_id}#{out.index}"
            outputs.setdefault(key, []).extend(out.new_token_ids)
        if check_invariants:
            engine.check_invariants()
    return outputs


def generate(
    engine: EngineCore, prompts: dict[str, Sequence[int]], params: SamplingParams
) -> dict[str, list[int]]:
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
    return run_to_completion(engine)
