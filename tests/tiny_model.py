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


# The tiny Llama's shape: 2 layers, GQA 4/2, peaked random weights (initializer range 0.2).
TINY_LLAMA: dict[str, Any] = {
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


def make_tiny_llama(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A 2-layer Llama with GQA and peaked random weights, saved with a manifest like a prepared dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    settings = _tiny_settings(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.save_pretrained(str(path))
    write_word_tokenizer(path, settings["vocab_size"])
    write_manifest(path, compute_manifest(path))
    return path


# Wider and deeper than the default: a 3000-token prefill or a few thousand decode steps take seconds on one
# thread, long enough for a fault to land while they run.
WIDE = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "num_hidden_layers": 4,
    "max_position_embeddings": 4096,
}


def make_wide_tiny_llama(path: Path, **overrides: Any) -> Path:
    """`make_tiny_llama` at the WIDE shape (`overrides` win)."""
    return make_tiny_llama(path, **{**WIDE, **overrides})


def _save_tiny(path: Path, model: Any, vocab_size: int) -> Path:
    model.save_pretrained(str(path))
    write_word_tokenizer(path, vocab_size)
    write_manifest(path, compute_manifest(path))
    return path


def _tiny_settings(overrides: dict[str, Any]) -> dict[str, Any]:
    return {**TINY_LLAMA, **overrides}


def make_tiny_qwen2(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A 2-layer Qwen2 (q/k/v biases, random too) with GQA, saved with a manifest."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = _tiny_settings(overrides)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**settings)).eval()
    with torch.no_grad():  # biases start at zero: make them matter
        for name, param in model.named_parameters():
            if name.endswith("_proj.bias"):
                param.normal_(0.0, 0.2)
    return _save_tiny(path, model, settings["vocab_size"])


def make_tiny_qwen3(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A 2-layer Qwen3 whose head_dim (32) is not hidden / heads (16), with random q/k norm weights."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    settings = _tiny_settings({"head_dim": 32, **overrides})
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**settings)).eval()
    with torch.no_grad():  # norms start at one: make them matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    return _save_tiny(path, model, settings["vocab_size"])


def make_tiny_gemma3(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A 4-layer Gemma 3: local layers with an 8-token window around one global layer, head_dim 32,
    query_pre_attn_scalar 24 (so the scale is not head_dim's), random (1 + w) norm weights."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    settings = _tiny_settings(
        {
            "num_hidden_layers": 4,
            "head_dim": 32,
            "num_key_value_heads": 1,
            "sliding_window": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "pad_token_id": 0,
            "bos_token_id": 2,
            **overrides,
        }
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**settings)).eval()
    with torch.no_grad():  # Gemma norms start at zero (a scale of one): make them matter
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
    return _save_tiny(path, model, settings["vocab_size"])
