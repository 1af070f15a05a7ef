"""`kvrelay generate`: offline batch generation through the real CLI on the real model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.cli.main import main

pytestmark = pytest.mark.model


def test_generate_writes_lines_in_input_order_with_a_clean_error_for_a_bad_line(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = [
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        {"prompt": "The capital of France is", "max_tokens": 5},
        {"prompt": ""},  # encodes to no tokens: an empty prompt
        "not an object",
        {"messages": [{"role": "user", "content": "Say hi."}], "n": 2, "temperature": 0.8, "seed": 1},
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["--input", str(src), "--output", str(out), "--model", str(model_dir), "--max-tokens", "16"]
    code = main(["generate", *args, "--dtype", "float32", "--no-progress"])
    assert code == 3  # some lines failed, and every line was still written
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in results] == [0, 1, 2, 3, 4]
    assert "Paris" in results[0]["text"]
    assert results[0]["finish_reason"] == "stop"
    assert results[0]["completion_tokens"] == len(results[0]["token_ids"])
    assert results[1]["completion_tokens"] == 5 and results[1]["finish_reason"] == "length"
    assert results[2]["error"]["type"] == "EmptyPromptError"
    assert "not a JSON object" in results[3]["error"]["message"]
    assert len(results[4]["choices"]) == 2
    assert "wrote 5 lines" in capsys.readouterr().err
