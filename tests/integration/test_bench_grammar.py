"""`kvrelay bench grammar` end to end on a tiny random-weight model that spells with SmolLM2's tokenizer:
both sides decode every token asked for (no sample can complete the schema's fifty people in 16 tokens),
and the JSON and the plot are written. No timing is asserted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from services.codec.text.tokenizer import CHAT_TEMPLATE_FILE
from services.common.manifest import compute_manifest, write_manifest
from tests.bench_helpers import run_kvrelay
from tests.grammar_helpers import make_tiny_smollm2_vocab_llama

pytestmark = pytest.mark.model


def test_bench_grammar_measures_both_sides(model_dir: Path, tmp_path: Path) -> None:
    model = make_tiny_smollm2_vocab_llama(tmp_path / "tiny", model_dir)
    shutil.copy(model_dir / CHAT_TEMPLATE_FILE, model / CHAT_TEMPLATE_FILE)  # the bench renders chat prompts
    write_manifest(model, compute_manifest(model))
    out, png = tmp_path / "grammar.json", tmp_path / "grammar.png"
    args = ["bench", "grammar", "--model", str(model), "--concurrency", "1,4", "--new-tokens", "16"]
    done = run_kvrelay([*args, "--json", str(out), "--plot", str(png)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "schema / free" in done.stdout
    result = json.loads(out.read_text())
    assert set(result["batches"]) == {"1", "4"}
    for batch, side in result["batches"].items():
        assert side["schema_tokens"] == int(batch) * 16
        assert side["free_tok_s"] > 0 and side["schema_tok_s"] > 0
    assert png.stat().st_size > 0
