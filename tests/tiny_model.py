"""Tiny random-weight models that tests build with transformers, for architectures and fast engine tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from services.common.manifest import compute_manifest, write_manifest


def write_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer whose tokens are t0..t{vocab_size-1}; t1 is EOS."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    hf = HFTokenizer(WordLevel(vocab, unk_token="t0"))
    hf.pre_tokenizer = WhitespaceSplit()
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1", "bos_token": "t0"}))


def make_tiny_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A 2-layer Llama with GQA and peaked random weights, saved with a manifest like a prepared dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    settings: dict[str, Any] = {
        "vocab_size": 128,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "initializer_range": 0.2,
    }
    settings.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.save_pretrained(str(path))
    write_word_tokenizer(path, settings["vocab_size"])
    write_manifest(path, compute_manifest(path))
    return path
