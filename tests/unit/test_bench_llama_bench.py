"""`kvrelay bench engine --peer llama.cpp` reads llama-bench's JSON: prefill from an empty cache, decode at
`--depth` (llama-bench's -d). A stand-in llama-bench (the seam: llama.cpp is never built in CI) logs its
arguments and prints one row per (test, depth), each with its own rate."""

from __future__ import annotations

import argparse
import json
import random
import stat
import sys
from pathlib import Path

import pytest

from services.bench.engine import at_depth, measure_llama_bench
from services.common.manifest import GGUF_WEIGHTS_NAME

STAND_IN = """#!{python}
import json, sys
argv = sys.argv[1:]
open({log!r}, "w").write(json.dumps(argv))
depths = [int(d) for d in argv[argv.index("-d") + 1].split(",")]
rows = []
for depth in depths:
    rows.append({{"n_prompt": 16, "n_gen": 0, "n_depth": depth, "avg_ts": 1000.0 + depth}})
    rows.append({{"n_prompt": 0, "n_gen": 4, "n_depth": depth, "avg_ts": 100.0 + depth}})
print(json.dumps(rows))
"""


@pytest.mark.parametrize("depth", [0, 300])
def test_prefill_comes_from_an_empty_cache_and_decode_from_the_asked_depth(
    tmp_path: Path, depth: int
) -> None:
    (tmp_path / GGUF_WEIGHTS_NAME).write_bytes(b"GGUF")
    log = tmp_path / "argv.json"
    stand_in = tmp_path / "llama-bench"
    stand_in.write_text(STAND_IN.format(python=sys.executable, log=str(log)))
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)
    args = argparse.Namespace(model=str(tmp_path), threads=2, prefill_tokens=16, new_tokens=4, depth=depth)

    peer = measure_llama_bench(args, stand_in)

    argv = json.loads(log.read_text())
    assert argv[argv.index("-d") + 1] == ("0" if depth == 0 else f"0,{depth}")
    assert argv[argv.index("-m") + 1] == str(tmp_path / GGUF_WEIGHTS_NAME)
    assert peer["prefill_tok_s"] == 1000.0
    assert peer["decode"] == {"1": {"tok_s": 100.0 + depth}}


def test_decode_prompts_sit_behind_depth_tokens_of_their_own() -> None:
    prompts = [[5, 6, 7], [8, 9]]
    deep = at_depth(prompts, 4, random.Random(0))
    assert [p[4:] for p in deep] == prompts
    assert all(100 <= t < 30000 for p in deep for t in p[:4])
    assert deep[0][:4] != deep[1][:4]  # no shared prefix for the cache to hit
    assert at_depth(prompts, 0, random.Random(0)) == prompts
