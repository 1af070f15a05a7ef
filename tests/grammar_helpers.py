"""Structured-output test helpers: a tiny random-weight Llama that spells with SmolLM2's tokenizer (its
unconstrained output is noise, so only the grammar makes it JSON), and decoding its samples."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from services.common.manifest import compute_manifest, write_manifest
from tests.tiny_model import make_tiny_llama

SMOLLM2_VOCAB_SIZE = 49152
SMOLLM2_EOS = 2  # <|im_end|>, SmolLM2's eos_token_id
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_tiny_smollm2_vocab_llama(
    path: Path, smollm2_dir: Path, padded_boost: float = 1.0, **overrides: Any
) -> Path:
    """A 2-layer random Llama over SmolLM2's vocabulary, with its tokenizer. A `vocab_size` past SmolLM2's
    pads the logits; `padded_boost` scales the padded rows of the (tied) embedding, so unconstrained noise
    picks padded IDs often."""
    settings: dict[str, Any] = {
        "vocab_size": SMOLLM2_VOCAB_SIZE,
        "bos_token_id": 1,
        "eos_token_id": SMOLLM2_EOS,
        "max_position_embeddings": 1024,
        **overrides,
    }
    make_tiny_llama(path, **settings)
    if padded_boost != 1.0:
        weights = load_file(str(path / "model.safetensors"))
        weights["model.embed_tokens.weight"][SMOLLM2_VOCAB_SIZE:] *= padded_boost
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copy(smollm2_dir / name, path / name)
    write_manifest(path, compute_manifest(path))
    return path


def decode(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """The text of a sample's tokens, EOS and other special tokens left out (as the codec does)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)
