"""`kvrelay bench grammar`: the cost of structured output, on our engine alone, in one run.

The same prompts at each concurrency, decoded without a constraint and then under a JSON schema (a list
of people with bounded strings, integers, booleans and an enum, long enough that no sample completes it
within `--new-tokens`, so both sides decode the same number of tokens). Reported: decode tok/s of each
and their ratio, as a table, JSON and a PNG bar chart. Sampling is greedy on both sides; `ignore_eos` on
the free side, while on the constrained side the grammar forbids EOS until the value is complete.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from services.bench.engine import build_engine, chat_prompts, run_batch
from services.bench.plots import plot_grammar
from services.bench.tables import format_table
from services.common.grammar import GrammarSpec
from services.common.sampling import SamplingParams

PEOPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 50,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 1, "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "likes_cats": {"type": "boolean"},
                    "colour": {"enum": ["red", "green", "blue"]},
                },
                "required": ["name", "age", "likes_cats", "colour"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["people"],
    "additionalProperties": False,
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("grammar", help="decode throughput with a JSON-schema constraint against without")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--concurrency", default="1,32", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.concurrency.split(",")]
    engine = build_engine(args, max(batches))
    grammar = GrammarSpec.json_schema(PEOPLE_SCHEMA)
    result: dict[str, Any] = {"model": str(args.model), "new_tokens": args.new_tokens, "batches": {}}
    for batch in batches:
        prompts = chat_prompts(Path(args.model), batch)
        free = run_batch(engine, prompts, args.new_tokens, f"free-{batch}")
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, grammar=grammar)
        constrained = run_batch(engine, prompts, args.new_tokens, f"schema-{batch}", params)
        result["batches"][str(batch)] = {
            "free_tok_s": free["tok_s"],
            "schema_tok_s": constrained["tok_s"],
            "ratio": constrained["tok_s"] / free["tok_s"],
            "schema_tokens": constrained["num_tokens"],
        }
    header = ["batch", "free tok/s", "schema tok/s", "schema / free"]
    rows = [
        [b, f"{r['free_tok_s']:.1f}", f"{r['schema_tok_s']:.1f}", f"{r['ratio']:.3f}"]
        for b, r in result["batches"].items()
    ]
    print(format_table(header, rows))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.plot is not None:
        plot_grammar(result, args.plot)
    return 0
