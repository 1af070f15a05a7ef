"""Tiny random T5 models for tests (issue 51), and a byte-level tokenizer.json in the ByT5 style.

`make_tiny_t5` writes a model directory (config.json, model.safetensors, tokenizer.json) and returns the
transformers model it came from, the reference the engine is compared with. transformers 5 ties T5's LM
head to the embeddings whatever the config says, so an untied model gets its own head here, in memory and
in the file, and the reference computes with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

BYTE_OFFSET = 3  # ByT5: pad 0, EOS 1, unk 2, then byte b is b + 3
VOCAB_SIZE = 256 + BYTE_OFFSET

# The tiny T5's shape: 3 encoder and 2 decoder layers, 3 heads of 8 (heads x d_kv is not d_model, as in
# no real T5 either, so neither mix-up can pass); initializer_factor raised (1.5) so the logits are not flat.
TINY_T5: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "d_model": 32,
    "d_kv": 8,
    "d_ff": 64,
    "num_layers": 3,
    "num_decoder_layers": 2,
    "num_heads": 3,
    "relative_attention_num_buckets": 8,
    "relative_attention_max_distance": 20,
    "decoder_start_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "initializer_factor": 1.5,
}


def byte_tokenizer() -> Tokenizer:
    """ByT5's encoding as a tokenizer.json: each UTF-8 byte b is one token b + 3, EOS (1) appended. The
    bytes pass through the byte-level pre-tokenizer (one printable character per byte, GPT-2's table), one
    token each."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    vocab |= {char: b + BYTE_OFFSET for b, char in enumerate(_byte_chars())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            pre_tokenizers.Split(Regex("."), behavior="isolated"),
        ]
    )
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<pad>", "</s>", "<unk>"])
    return tokenizer


def _byte_chars() -> list[str]:
    """The byte-level pre-tokenizer's character for each byte 0..255 (GPT-2's bytes-to-unicode table)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def make_tiny_t5(
    path: Path, *, gated: bool = False, tied: bool = True, seed: int = 0, saved_by_transformers5: bool = False
) -> tuple[Path, Any]:
    """A tiny random T5 (ReLU or gated GELU, tied or untied head) written to `path`; its transformers
    model, in eval mode, for reference. As the hub's checkpoints were saved (config.json's
    tie_word_embeddings says which, a tied head is not stored), or `saved_by_transformers5`: every table
    stored (the stacks' embeddings, the head even when it is the embeddings), tie_word_embeddings always
    true and scale_decoder_outputs saying what the head does."""
    from transformers import T5Config, T5ForConditionalGeneration

    path.mkdir(parents=True, exist_ok=True)
    proj = "gated-gelu" if gated else "relu"
    config = T5Config(**TINY_T5, feed_forward_proj=proj, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config).eval()
    if not tied:  # its own head (transformers 5 would tie it), logits of the spread a tied head gives
        head = torch.randn_like(model.shared.weight) * model.shared.weight.std() * config.d_model**-0.5
        model.lm_head.weight = torch.nn.Parameter(head)
    state = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
    raw = {**TINY_T5, "architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}
    raw |= {"feed_forward_proj": proj, "tie_word_embeddings": tied, "is_encoder_decoder": True}
    if saved_by_transformers5:
        for stack in ("encoder", "decoder"):
            state[f"{stack}.embed_tokens.weight"] = state["shared.weight"].clone()
        state["lm_head.weight"] = model.lm_head.weight.detach().clone()
        raw |= {"tie_word_embeddings": True, "scale_decoder_outputs": tied}
    else:
        state = {n: t for n, t in state.items() if not n.endswith("embed_tokens.weight")}  # they are `shared`
        if tied:
            state.pop("lm_head.weight", None)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw, indent=1))
    byte_tokenizer().save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "pad_token": "<pad>"}))
    return path, model
