"""Record transformers' fp32 greedy `generate` output for the identity tests (`make fixtures`).

For each prompt: the prompt's token IDs, the first 64 generated token IDs (EOS banned until then, as
`min_new_tokens` does; the engine gets `min_tokens`), and the top-2 raw-logit gap at each position,
so a test can tell a real divergence from a near-tie without rerunning transformers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoModelForCausalLM

from services.codec.text.chat_template import chat_template_from_tokenizer, render_and_encode
from services.codec.text.tokenizer import Tokenizer
from services.common.manifest import load_verified_manifest
from tests.reference_prompts import raw_reference_cases, reference_cases

NUM_NEW_TOKENS = 64


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument(
        "--raw-only", action="store_true", help="raw prompts only (a model without a chat template)"
    )
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    manifest = load_verified_manifest(args.model)
    tokenizer = Tokenizer.from_dir(args.model)
    model = AutoModelForCausalLM.from_pretrained(str(args.model), dtype=torch.float32).eval()
    cases = []
    for case in raw_reference_cases() if args.raw_only else reference_cases():
        if "messages" in case:
            template = chat_template_from_tokenizer(tokenizer)
            prompt_ids = render_and_encode(template, tokenizer, case["messages"])
        else:
            prompt_ids = tokenizer.encode(case["prompt"], add_special_tokens=True)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt_ids]),
                attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=NUM_NEW_TOKENS,
                min_new_tokens=NUM_NEW_TOKENS,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tokenizer.eos_token_id,
            )
        gaps = []
        for logits in out.logits:
            top2 = torch.topk(logits[0].float(), 2).values
            gaps.append(float(top2[0] - top2[1]))
        output_ids = out.sequences[0, len(prompt_ids) :].tolist()
        cases.append(
            {
                "name": case["name"],
                "prompt_token_ids": prompt_ids,
                "output_token_ids": output_ids,
                "top2_gaps": gaps,
            }
        )
        took = time.perf_counter() - t0
        print(f"{case['name']}: {len(prompt_ids)} prompt tokens, {took:.1f}s", file=sys.stderr)
    fixture = {
        "model_fingerprint": manifest.model_fingerprint,
        "generator": f"transformers {__import__('transformers').__version__} generate, fp32, greedy",
        "num_new_tokens": NUM_NEW_TOKENS,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
