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


def test_generate_feeds_an_encoder_decoder_model_its_prompt_as_the_encoder_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    from services.common.manifest import compute_manifest, write_manifest
    from tests.tiny_t5 import byte_tokenizer, make_tiny_t5

    t5_dir, reference = make_tiny_t5(tmp_path / "t5", gated=True, tied=False)
    write_manifest(t5_dir, compute_manifest(t5_dir))
    lines = [
        {"prompt": "translate: the cat"},
        {"prompt": "summarize this", "decoder_prompt": "ab", "max_tokens": 6},
        {"messages": [{"role": "user", "content": "hi"}]},  # no chat template in a T5 directory
    ]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = ["--input", str(src), "--output", str(out), "--model", str(t5_dir), "--max-tokens", "12"]
    assert main(["generate", *args, "--dtype", "float32", "--no-progress"]) == 3
    results = [json.loads(x) for x in out.read_text().splitlines()]
    source = byte_tokenizer().encode("translate: the cat").ids  # ends with EOS, as T5's tokenizer does
    assert results[0]["prompt_tokens"] == len(source)
    with torch.no_grad():
        generated = reference.generate(
            torch.tensor([source]), max_new_tokens=12, do_sample=False, num_beams=1, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    want = generated.sequences[0, 1:].tolist()
    for step, (a, b) in enumerate(zip(results[0]["token_ids"], want, strict=False)):
        if a != b:
            top2 = generated.scores[step][0].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3, f"diverged at step {step}"
            break
    else:
        assert results[0]["token_ids"] == want[: len(results[0]["token_ids"])]
    assert results[1]["completion_tokens"] <= 6 and "error" not in results[1]
    assert "error" in results[2]
    assert "wrote 3 lines" in capsys.readouterr().err
