"""Decode graphs (services/engine/cuda_graphs.py) on the CPU: the same buckets, padding and static buffers as
on a GPU, the captured callable replayed eagerly, over the Triton kernels under the interpreter.

A replay runs under a dispatch mode that fails on a host sync (`.item()`/`.tolist()`, `nonzero`) or a
tensor made from host data, and two replays in one bucket record the same operations and shapes. Greedy
tokens through the graphs equal the eager path's, padded buckets included.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from services.common.errors import ConfigError
from services.common.sampling import SamplingParams
from services.engine.cuda_graphs import DecodeGraphs, decode_buckets
from services.engine.layers.attention_metadata import RowSpec, build_metadata
from services.engine.runner import ModelRunner
from tests.engine_helpers import make_engine, run_to_completion
from tests.tiny_model import make_tiny_llama

SHAPE = {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
ENGINE: dict[str, Any] = {"attention": "triton", "block_size": 16, "max_model_len": 128}
# .item() and float(t) (aten.item under inference mode), nonzero, torch.tensor(host data). `.tolist()` and
# `.cpu()` of a CPU tensor dispatch nothing on a CPU: on a GPU they are aten._local_scalar_dense/_to_copy.
FORBIDDEN = {
    "aten._local_scalar_dense.default",
    "aten.item.default",
    "aten.nonzero.default",
    "aten.lift_fresh.default",
}


class RecordOps(TorchDispatchMode):
    """Records each op with its output shapes; raises on an op a captured graph cannot hold. Also keeps a
    weak reference to every tensor an op allocated (an output that is neither a view of nor a write into
    one of that op's inputs), so a test can check that none outlives the replay."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[tuple[int, ...], ...]]] = []
        self.fresh: list[weakref.ref[torch.Tensor]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func)
        if name in FORBIDDEN:
            raise AssertionError(f"{name} in a graph replay: a host sync or a tensor from host data")
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **(kwargs or {}))
        outs = [t for t in (out if isinstance(out, tuple | list) else (out,)) if isinstance(t, torch.Tensor)]
        self.ops.append((name, tuple(tuple(t.shape) for t in outs)))
        aliases = {t.untyped_storage().data_ptr() for t in inputs}  # alive now: a match is a view or in-place
        for t in outs:
            if t.untyped_storage().data_ptr() not in aliases:
                self.fresh.append(weakref.ref(t))
        return out


def test_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 100]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("graphs") / "llama", **SHAPE)


@pytest.mark.parametrize("split", [None, False])
def test_greedy_tokens_through_the_graphs_equal_the_eager_paths(model_dir: Path, split: bool | None) -> None:
    """split None: these buckets take split-KV (few rows); False: the paged kernel over padded rows."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = {f"r{i}": [(5 * i + 3 * j) % 120 + 2 for j in range(3 + 7 * i)] for i in range(5)}
    results = []
    for graphs in (False, True):
        engine = make_engine(model_dir, "float32", batch_size_limit=8, cuda_graphs=graphs, **ENGINE)
        if graphs and split is False:
            recapture_unsplit(engine)
        for request_id in ("r0", "r1", "r2"):  # three rows: bucket 4, one padded row
            engine.add_request(request_id, prompts[request_id], params)
        out = run_to_completion(engine)
        for request_id in ("r3", "r4"):  # then two: bucket 2
            engine.add_request(request_id, prompts[request_id], params)
        results.append(out | run_to_completion(engine))
        runner = engine.runner
        assert isinstance(runner, ModelRunner)
        if graphs:
            assert runner.graphs is not None and runner.graphs.buckets == [1, 2, 4, 8]
            assert runner.graphs.num_replays[4] > 0 and runner.graphs.num_replays[2] > 0
        else:
            assert runner.graphs is None
    assert results[1] == results[0]


def recapture_unsplit(engine: Any) -> None:
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.graphs is not None
    old = runner.graphs
    old.paged.split = False  # type: ignore[attr-defined]
    runner.graphs = DecodeGraphs(runner.model, old.paged, runner.kv_caches, 16, old.max_rows, old.max_blocks)
    runner.graphs.capture()
    layout = runner.graphs._static_meta(4).backend_state[old.paged]
    assert layout.split_decode is False  # type: ignore[attr-defined]


def test_dropping_the_engine_frees_its_kv_cache_without_the_garbage_collector(model_dir: Path) -> None:
    engine = make_engine(model_dir, "float32", batch_size_limit=8, cuda_graphs=True, **ENGINE)
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and runner.graphs is not None
    cache = weakref.ref(runner.kv_caches[0])
    gc.disable()
    try:
        del engine, runner
        assert cache() is None, "a reference cycle keeps the KV cache (and on a GPU the graphs) alive"
    finally:
        gc.enable()


def test_a_replay_syncs_nothing_and_repeats_its_operations(model_dir: Path) -> None:
    engine = make_engine(model_dir, "float32", batch_size_limit=8, cuda_graphs=True, **ENGINE)
    runner = engine.runner
    assert isinstance(runner, ModelRunner) and isinstance(runner.graphs, DecodeGraphs)
    graphs = runner.graphs
    recorded = []
    for contexts in ([5, 17, 30], [9, 40, 2]):  # one bucket (4), different lengths and blocks
        rows = [
            RowSpec([i + 3 * r for i in range(-(-ctx // 16))], ctx - 1, 1) for r, ctx in enumerate(contexts)
        ]
        bucket = graphs.load(torch.tensor([7, 8, 9]), build_metadata(rows, [], 16))
        assert bucket == 4
        with RecordOps() as mode:
            logits = graphs.replay(bucket)
        assert logits.shape[0] == 4 and bool(torch.isfinite(logits).all())
        recorded.append(mode.ops)
        gc.collect()
        kept = [t.shape for ref in mode.fresh if (t := ref()) is not None]
        assert not kept, f"a replay allocated tensors that outlive it (a graph's pool would grow): {kept}"
        assert mode.fresh, "the replay's own temporaries are seen"
    assert recorded[0] == recorded[1] and len(recorded[0]) > 20


def test_graphs_with_torch_native_attention_are_refused(model_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"engine\.cuda_graphs needs graph-safe attention"):
        make_engine(model_dir, "float32", cuda_graphs=True, attention="torch")
