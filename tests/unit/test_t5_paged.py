"""T5's decoder over the paged cache (services/engine/models/t5_paged.py): sequences batched in one step,
decode rows beside prefill chunks, self KV in shuffled blocks, cross KV in blocks of their own, give the
logits of each sequence decoded alone (t5.py, checked against transformers in test_t5_model.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from services.engine.layers.attention_metadata import RowSpec, build_metadata
from services.engine.layers.kv_cache import KVCacheSpec, allocate_kv_caches
from services.engine.models.t5 import T5Config, T5Model
from services.engine.models.t5_paged import CrossRow, forward, write_cross_kv
from tests.tiny_t5 import make_tiny_t5

BLOCK = 4


@pytest.fixture(scope="module", params=[(False, True), (True, False)], ids=["relu-tied", "gated-untied"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> T5Model:
    gated, tied = request.param
    path, _ = make_tiny_t5(tmp_path_factory.mktemp("t5"), gated=gated, tied=tied)
    config = T5Config.from_dict(json.loads((path / "config.json").read_text()))
    return T5Model(config, load_file(str(path / "model.safetensors")), torch.float32)


def test_a_batched_paged_step_gives_each_sequence_its_logits_alone(model: T5Model) -> None:
    generator = torch.Generator().manual_seed(7)
    sources = [torch.randint(3, 259, (n,), generator=generator) for n in (5, 19, 2)]
    targets = [
        torch.cat([torch.tensor([0]), torch.randint(3, 259, (9,), generator=generator)]) for _ in sources
    ]
    want = [model.decode(t, model.start(model.encode(s))) for s, t in zip(sources, targets, strict=True)]

    cfg = model.config
    spec = KVCacheSpec(cfg.num_decoder_layers, cfg.num_heads, cfg.d_kv, BLOCK, torch.float32)
    caches = allocate_kv_caches(spec, 40, torch.device("cpu"))
    free = torch.randperm(40, generator=generator).tolist()  # shuffled: no row's blocks are in order
    self_blocks = [[free.pop() for _ in range(3)] for _ in sources]  # 10 tokens in blocks of 4
    cross = [CrossRow([free.pop() for _ in range(-(-len(s) // BLOCK))], len(s)) for s in sources]
    for source, row in zip(sources, cross, strict=True):
        write_cross_kv(model, model.encode(source), row, caches, BLOCK)

    def step(decode: list[tuple[int, int]], prefill: list[tuple[int, int, int]]) -> None:
        """decode: (sequence, position); prefill: (sequence, start, count). Checks every new token."""
        order = [(i, p, 1) for i, p in decode] + list(prefill)
        meta = build_metadata(
            [RowSpec(self_blocks[i], p, 1) for i, p in decode],
            [RowSpec(self_blocks[i], s, n) for i, s, n in prefill],
            BLOCK,
        )
        tokens = torch.cat([targets[i][s : s + n] for i, s, n in order])
        logits = forward(
            model, tokens, caches, meta, torch.arange(len(tokens)), [cross[i] for i, _, _ in order]
        )
        got = logits.split([n for _, _, n in order])
        for (i, s, n), rows in zip(order, got, strict=True):
            torch.testing.assert_close(rows, want[i][s : s + n], atol=1e-4, rtol=0)  # other sum orders

    step([], [(0, 0, 6), (1, 0, 3)])  # two prompts, one whole, one chunked
    step([(0, 6)], [(1, 3, 5), (2, 0, 10)])  # a decode row beside two prefill chunks
    step([(0, 7), (1, 8)], [])  # decode rows alone
    step([(0, 8), (1, 9)], [])
