"""A T5 model directory of a real checkpoint's shape with random weights, for benches that measure bytes
and time, not text (`kvrelay bench transfer` of an encoder-decoder model): no model hub is reachable.

    PYTHONPATH=. .venv/bin/python scripts/make_random_t5.py --shape t5-base /tmp/t5-base
    .venv/bin/kvrelay bench transfer --model /tmp/t5-base --prompt-lengths 512 --load-seconds 0

The shapes are those of the hub's config.json files (t5-small, t5-base; flan-t5-base is gated GELU, its
head untied). The tokenizer is the tests' byte-level one (tests/tiny_t5.py): the bench sends token IDs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import T5Config, T5ForConditionalGeneration

from services.common.manifest import compute_manifest, write_manifest
from tests.tiny_t5 import byte_tokenizer

SHAPES = {
    "t5-small": {"d_model": 512, "d_kv": 64, "d_ff": 2048, "num_layers": 6, "num_heads": 8},
    "t5-base": {"d_model": 768, "d_kv": 64, "d_ff": 3072, "num_layers": 12, "num_heads": 12},
    "flan-t5-base": {
        "d_model": 768, "d_kv": 64, "d_ff": 2048, "num_layers": 12, "num_heads": 12,
        "feed_forward_proj": "gated-gelu", "tie_word_embeddings": False,
    },
}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="t5-base")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = T5Config(
        vocab_size=32128, decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, **SHAPES[args.shape]
    )
    model = T5ForConditionalGeneration(config).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    byte_tokenizer().save(str(args.out / "tokenizer.json"))
    write_manifest(args.out, compute_manifest(args.out))
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"wrote {args.shape} ({millions:.0f}M parameters) to {args.out}")


if __name__ == "__main__":
    main()
