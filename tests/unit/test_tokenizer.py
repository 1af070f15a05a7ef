"""Tokenizer: special tokens, EOS IDs and config handling, on SmolLM2 and on tiny model dirs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from services.codec.text.tokenizer import Tokenizer
from services.common.errors import CorruptModelError, ModelNotFoundError, TokenOutOfRangeError


def write_tiny_model(
    path: Path, config: dict[str, Any], generation_config: dict[str, Any] | None = None
) -> Path:
    hf = HFTokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "<eot>": 3, "hi": 4}, unk_token="<unk>"))
    hf.pre_tokenizer = Whitespace()
    hf.add_special_tokens(["<s>", "</s>", "<eot>"])
    hf.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.mark.model
def test_smollm2_special_tokens(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == (2,)
    assert tokenizer.token_to_id("<|im_start|>") == 1
    assert {0, 1, 2} <= tokenizer.special_token_ids
    assert tokenizer.vocab_size == 49152
    assert tokenizer.chat_template is not None and "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.decode([1, 4093, 2], skip_special_tokens=True) == "user"
    assert tokenizer.decode([1, 4093, 2], skip_special_tokens=False) == "<|im_start|>user<|im_end|>"


def test_eos_ids_merge_tokenizer_and_generation_config(tmp_path: Path) -> None:
    model_dir = write_tiny_model(tmp_path, {"eos_token": "</s>"}, {"eos_token_id": [3, 2, 3]})
    assert Tokenizer.from_dir(model_dir).eos_token_ids == (2, 3)


def test_special_tokens_may_be_added_token_dicts(tmp_path: Path) -> None:
    config = {"bos_token": {"__type": "AddedToken", "content": "<s>"}, "eos_token": {"content": "</s>"}}
    tokenizer = Tokenizer.from_dir(write_tiny_model(tmp_path, config))
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<s>", "</s>")
    assert tokenizer.eos_token_ids == (2,)


def test_add_bos_token_prepends_bos_only_with_special_tokens(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_tiny_model(tmp_path, {"bos_token": "<s>", "add_bos_token": True}))
    assert tokenizer.encode("hi", add_special_tokens=True) == [1, 4]
    assert tokenizer.encode("hi") == [4]
    assert tokenizer.encode("<s> hi", add_special_tokens=True) == [1, 4]


def test_convert_ids_to_tokens_rejects_unknown_id(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_tiny_model(tmp_path, {}))
    assert tokenizer.convert_ids_to_tokens([4, 2]) == ["hi", "</s>"]
    with pytest.raises(TokenOutOfRangeError):
        tokenizer.convert_ids_to_tokens([99])


def test_missing_directory_is_model_not_found(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        Tokenizer.from_dir(tmp_path / "absent")


def test_unparsable_config_is_corrupt(tmp_path: Path) -> None:
    write_tiny_model(tmp_path, {})
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(CorruptModelError):
        Tokenizer.from_dir(tmp_path)
