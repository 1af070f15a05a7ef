"""`kvrelay bench agreement` on the real model against a stand-in for llama.cpp's llama-completion (the
seam: building llama.cpp is never done in CI). The stand-in crashes with SIGSEGV unless given
`--no-repack`, as llama.cpp's AMX repacking did on a Sapphire Rapids VM, and answers each prompt with a
text the test chose: the fp32 fixture's own continuation for one prompt, another text for the other."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

from services.cli.main import main

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "smollm2_greedy_fp32.json"
TOKENS = 8

STAND_IN = """#!{python}
import json, os, signal, sys
argv = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps(argv) + "\\n")
if "--no-repack" not in argv:
    os.kill(os.getpid(), signal.SIGSEGV)
answers = json.load(open({answers!r}))
sys.stdout.write(answers[argv[argv.index("-p") + 1]] + " [end of text]\\n")
"""


def clear_cases(count: int) -> list[dict]:
    """Fixture cases whose first TOKENS greedy tokens lead their runner-up clearly and hold no EOS, so any
    of our weight forms gives them."""
    cases = json.loads(FIXTURE.read_text())["cases"]
    clear = [c for c in cases if min(c["top2_gaps"][:TOKENS]) > 0.5 and len(c["output_token_ids"]) > TOKENS]
    assert len(clear) >= count
    return clear[:count]


def test_agreement_counts_identical_continuations_and_reruns_a_crashed_peer_without_repacking(
    model_dir: Path, tmp_path: Path, capsys
) -> None:
    from services.codec.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    same, other = clear_cases(2)
    (tmp_path / "cases.json").write_text(json.dumps({"cases": [same, other]}))

    def prompt(case: dict) -> str:
        return tokenizer.decode(case["prompt_token_ids"], skip_special_tokens=False)

    answers = {
        prompt(same): tokenizer.decode(same["output_token_ids"][:TOKENS], skip_special_tokens=False),
        prompt(other): "a continuation our engine never writes",
    }
    (tmp_path / "answers.json").write_text(json.dumps(answers))
    log = tmp_path / "calls.jsonl"
    stand_in = tmp_path / "llama-completion"
    stand_in.write_text(
        STAND_IN.format(python=sys.executable, log=str(log), answers=str(tmp_path / "answers.json"))
    )
    stand_in.chmod(stand_in.stat().st_mode | stat.S_IXUSR)

    out, cases = tmp_path / "agreement.json", tmp_path / "cases.json"
    argv = [
        "bench", "agreement", str(stand_in), "--model", str(model_dir), "--cases", str(cases),
        "--weights", "gguf-int8", "--tokens", str(TOKENS), "--json", str(out),
    ]  # fmt: skip
    assert main(argv) == 0

    result = json.loads(out.read_text())
    assert result["share"] == 0.5
    rows = {row["name"]: row for row in result["rows"]}
    assert rows[same["name"]]["identical"] and rows[same["name"]]["kvrelay"] == answers[prompt(same)]
    assert not rows[other["name"]]["identical"]
    assert rows[other["name"]]["llama_cpp"] == answers[prompt(other)]
    printed = capsys.readouterr().out
    assert f"identical first {TOKENS} tokens: 50% of 2 prompts (gguf-int8)" in printed

    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4  # each prompt: the crash, then the rerun without repacking
    assert ["--no-repack" in call for call in calls] == [False, True, False, True]
    for call in calls:
        assert call[call.index("-m") + 1] == str(model_dir / "model.gguf")
        assert call[call.index("-n") + 1] == str(TOKENS) and call[call.index("--temp") + 1] == "0"
