"""Greedy continuations of kvrelay's GGUF block path against llama.cpp's on the same GGUF file.

    .venv/bin/python scripts/compare_llama_cpp.py LLAMA_COMPLETION [--weights gguf|gguf-int8] [--tokens 32]

For each prompt of tests/fixtures/smollm2_greedy_fp32.json: our engine's greedy first `--tokens` tokens
(model.weights as given; both stop early at EOS), and llama.cpp's greedy continuation of the same prompt
text (`llama-completion`, its plain-text tool: `--temp 0`, no chat mode, special tokens parsed), read back
as text. A prompt counts as identical when the two texts are equal. Prints one line per prompt and the
share identical, and writes them as JSON with --json. scripts/build_llama_bench.sh builds llama-completion.
Not in `make test`: llama.cpp is built from source for it (docs/performance.md has a run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from services.bench.engine import run_llama_cpp  # noqa: E402
from services.codec.text.tokenizer import Tokenizer  # noqa: E402
from services.common.manifest import GGUF_WEIGHTS_NAME  # noqa: E402
from services.common.sampling import SamplingParams  # noqa: E402
from tests.engine_helpers import make_engine, run_to_completion  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "smollm2_greedy_fp32.json"


def llama_cli_text(
    llama_cli: Path, gguf: Path, prompt: str, num_tokens: int, threads: int, extra: list[str]
) -> str:
    command = [
        str(llama_cli), "-m", str(gguf), "-p", prompt, "-n", str(num_tokens), "--temp", "0",
        "-t", str(threads), "-c", "4096", "-no-cnv", "--no-display-prompt", "--simple-io", "--no-warmup",
        "-s", "0", "-sp", *extra,
    ]  # fmt: skip
    stdout, _ = run_llama_cpp(command, ["--no-repack"], timeout_s=600)
    # It ends the text with the end-of-generation token and a marker; ours stops before both.
    return stdout.rstrip("\n").removesuffix(" [end of text]").removesuffix("<|im_end|>")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("llama_cli", type=Path)
    parser.add_argument("--model", type=Path, default=REPO / "models" / "smollm2-135m-instruct")
    parser.add_argument("--weights", default="gguf", choices=["gguf", "gguf-int8", "safetensors"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument(
        "--llama-arg", action="append", default=[], help="passed on to llama.cpp (repeat), e.g. -ctk=f32"
    )
    args = parser.parse_args()

    cases = json.loads(FIXTURE.read_text())["cases"]
    tokenizer = Tokenizer.from_dir(args.model)
    engine = make_engine(args.model, "float32", batch_size_limit=32, weights=args.weights)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)  # both stop at EOS
    for case in cases:
        engine.add_request(case["name"], case["prompt_token_ids"], params)
    ours = run_to_completion(engine)
    rows = []
    for case in cases:
        prompt = tokenizer.decode(case["prompt_token_ids"], skip_special_tokens=False)
        mine = tokenizer.decode(ours[case["name"]], skip_special_tokens=False)
        theirs = llama_cli_text(
            args.llama_cli, args.model / GGUF_WEIGHTS_NAME, prompt, args.tokens, args.threads, args.llama_arg
        )
        mine = mine.removesuffix("<|im_end|>")  # llama.cpp does not print the end-of-generation token
        same = mine == theirs
        rows.append({"name": case["name"], "identical": same, "kvrelay": mine, "llama_cli": theirs})
        print(f"{'same' if same else 'DIFF'}  {case['name']}")
    share = sum(r["identical"] for r in rows) / len(rows)
    setting = "; ".join([args.weights, *([" ".join(args.llama_arg)] if args.llama_arg else [])])
    print(f"identical first {args.tokens} tokens: {share:.0%} of {len(rows)} prompts ({setting})")
    if args.json:
        result = {"weights": args.weights, "llama_args": args.llama_arg, "share": share, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
