"""Tool-calling test helpers: tiny random-weight models that spell with SmolLM2's tokenizer plus a family's
call and thinking markers as added tokens, so grammars can name a marker by its token ID.

    Qwen3-style   a Qwen3 architecture; `<tool_call>` `</tool_call>` `<think>` `</think>` added as
                  non-special tokens (as in Qwen3's own tokenizer.json): they decode as their text
    Llama 3       a Llama architecture; `<|python_tag|>` added as a special token (as in Llama 3's)

Their unconstrained output is noise, so a call that parses and validates is the grammar's doing.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from services.common.manifest import compute_manifest, write_manifest
from tests.grammar_helpers import SMOLLM2_EOS, SMOLLM2_VOCAB_SIZE, make_tiny_smollm2_vocab_llama
from tests.tiny_model import make_tiny_qwen3

QWEN3_MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>")
LLAMA3_MARKERS = ("<|python_tag|>",)
PADDED_VOCAB_SIZE = SMOLLM2_VOCAB_SIZE + 64  # the logits' width: past the added tokens, padded


def add_marker_tokens(
    path: Path, smollm2_dir: Path, markers: Sequence[str], *, special: bool
) -> dict[str, int]:
    """Writes SmolLM2's tokenizer with `markers` added (after its 49152 tokens) into `path`, its
    tokenizer_config.json listing them too; each marker's token ID."""
    tokenizer = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    added = [AddedToken(marker, special=special, normalized=False) for marker in markers]
    count = tokenizer.add_special_tokens(added) if special else tokenizer.add_tokens(added)
    assert count == len(markers), f"only {count} of {markers} were added"
    tokenizer.save(str(path / "tokenizer.json"))
    ids = {marker: tokenizer.token_to_id(marker) for marker in markers}
    config = json.loads((smollm2_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    decoder: dict[str, Any] = config.setdefault("added_tokens_decoder", {})
    for marker, token_id in ids.items():
        decoder[str(token_id)] = {
            "content": marker,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": special,
        }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return ids


def make_tiny_qwen3_with_markers(path: Path, smollm2_dir: Path) -> Path:
    """A 2-layer random Qwen3 over SmolLM2's vocabulary plus Qwen3's four markers (IDs 49152-49155)."""
    make_tiny_qwen3(
        path,
        vocab_size=PADDED_VOCAB_SIZE,
        bos_token_id=1,
        eos_token_id=SMOLLM2_EOS,
        max_position_embeddings=1024,
    )
    add_marker_tokens(path, smollm2_dir, QWEN3_MARKERS, special=False)
    write_manifest(path, compute_manifest(path))
    return path


def make_tiny_llama3_with_markers(path: Path, smollm2_dir: Path) -> Path:
    """A 2-layer random Llama over SmolLM2's vocabulary plus the special `<|python_tag|>` (ID 49152)."""
    make_tiny_smollm2_vocab_llama(path, smollm2_dir, vocab_size=PADDED_VOCAB_SIZE)
    add_marker_tokens(path, smollm2_dir, LLAMA3_MARKERS, special=True)
    write_manifest(path, compute_manifest(path))
    return path


def marker_ids(tokenizer: Tokenizer, markers: Collection[str]) -> dict[str, int]:
    """Each marker that is one token of `tokenizer`, with its ID."""
    ids = {marker: tokenizer.token_to_id(marker) for marker in markers}
    return {marker: token_id for marker, token_id in ids.items() if token_id is not None}


def decode_keeping_markers(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """A sample's text with every marker spelled out (special ones too), EOS and padded IDs left out."""
    kept = [t for t in token_ids if t != SMOLLM2_EOS and t < tokenizer.get_vocab_size(with_added_tokens=True)]
    return tokenizer.decode(kept, skip_special_tokens=False)
