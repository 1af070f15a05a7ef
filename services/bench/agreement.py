"""`kvrelay bench agreement`: greedy continuations of our engine against llama.cpp's on the same GGUF file.

    kvrelay bench agreement LLAMA_COMPLETION [--weights gguf|gguf-int8] [--tokens 32] [--llama-arg=-ctk ...]

For each prompt of the fixture (`--cases`, by default tests/fixtures/smollm2_greedy_fp32.json): our
engine's greedy first `--tokens` tokens (model.weights as given; both sides stop early at EOS), and
llama.cpp's greedy continuation of the same prompt text (`llama-completion`, its plain-text tool: `--temp
0`, no chat mode, special tokens parsed), read back as text. A prompt counts as identical when the two
texts are equal. Prints one line per prompt and the share identical; `--json` writes them.
scripts/build_llama_bench.sh builds llama-completion; docs/performance.md has a run. A quality check, not
a speed one: it lives here because it runs the same peer binary family as `kvrelay bench engine --peer`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.bench.engine import run_llama_cpp
from services.common.sampling import SamplingParams

# llama.cpp prints the end-of-generation token's text and a marker; our decoded text stops before both.
END_OF_TEXT = " [end of text]"
END_OF_TURN = "<|im_end|>"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("agreement", help="greedy continuations against llama.cpp's on the same GGUF")
    p.add_argument("llama_completion", type=Path, help="llama.cpp's llama-completion binary")
    p.add_argument("--model", type=Path, default=Path("models/smollm2-135m-instruct"))
    p.add_argument("--cases", type=Path, default=Path("tests/fixtures/smollm2_greedy_fp32.json"))
    p.add_argument("--weights", default="gguf", choices=["gguf", "gguf-int8", "safetensors"])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None, help="write the rows and the share here")
    p.add_argument(
        "--llama-arg",
        action="append",
        default=[],
        help="one argument passed on to llama.cpp (repeat): --llama-arg=-ctk --llama-arg=f32",
    )
    p.set_defaults(handler=run)


def llama_completion_text(args: argparse.Namespace, gguf: Path, prompt: str) -> str:
    command = [
        str(args.llama_completion), "-m", str(gguf), "-p", prompt, "-n", str(args.tokens), "--temp", "0",
        "-t", str(args.threads), "-c", "4096", "-no-cnv", "--no-display-prompt", "--simple-io",
        "--no-warmup", "-s", "0", "-sp", *args.llama_arg,
    ]  # fmt: skip
    stdout, _ = run_llama_cpp(command, ["--no-repack"], timeout_s=600)
    return stdout.rstrip("\n").removesuffix(END_OF_TEXT).removesuffix(END_OF_TURN)


def greedy_tokens(args: argparse.Namespace, cases: list[dict[str, Any]]) -> dict[str, list[int]]:
    """Our engine's greedy continuation of every case, all in one batch, keyed by case name."""
    import torch

    from services.bench.engine import build_engine

    torch.set_num_threads(args.threads)
    engine_args = argparse.Namespace(model=args.model, dtype="float32")
    engine = build_engine(engine_args, batch_size_limit=len(cases), weights=args.weights)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens)  # both sides stop at EOS
    for case in cases:
        engine.add_request(case["name"], case["prompt_token_ids"], params)
    tokens: dict[str, list[int]] = {case["name"]: [] for case in cases}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def run(args: argparse.Namespace) -> int:
    from services.codec.text.tokenizer import Tokenizer
    from services.common.manifest import GGUF_WEIGHTS_NAME

    gguf = args.model / GGUF_WEIGHTS_NAME
    if not gguf.is_file():
        raise SystemExit(f"{args.model} keeps no {GGUF_WEIGHTS_NAME}: prepare it from a GGUF file")
    cases = json.loads(args.cases.read_text())["cases"]
    tokenizer = Tokenizer.from_dir(args.model)
    ours = greedy_tokens(args, cases)
    rows = []
    for case in cases:
        prompt = tokenizer.decode(case["prompt_token_ids"], skip_special_tokens=False)
        mine = tokenizer.decode(ours[case["name"]], skip_special_tokens=False).removesuffix(END_OF_TURN)
        theirs = llama_completion_text(args, gguf, prompt)
        same = mine == theirs
        rows.append({"name": case["name"], "identical": same, "kvrelay": mine, "llama_cpp": theirs})
        print(f"{'same' if same else 'DIFF'}  {case['name']}")
    share = sum(r["identical"] for r in rows) / len(rows)
    setting = "; ".join([args.weights, *([" ".join(args.llama_arg)] if args.llama_arg else [])])
    print(f"identical first {args.tokens} tokens: {share:.0%} of {len(rows)} prompts ({setting})")
    if args.json:
        result = {"weights": args.weights, "llama_args": args.llama_arg, "share": share, "rows": rows}
        args.json.write_text(json.dumps(result, indent=1))
    return 0
