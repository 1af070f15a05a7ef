"""The codec's tokenizer: text ↔ token IDs for one model directory, without torch.

Wraps a `tokenizers.Tokenizer` loaded from `tokenizer.json` and reads the Hugging Face side files
that change its behaviour: `tokenizer_config.json` (special tokens, `add_bos_token`, the chat
template) and `generation_config.json` (extra end-of-sequence IDs). `chat_template.jinja`, when
present, wins over a template embedded in `tokenizer_config.json`, as in transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from services.common.errors import CorruptModelError, ModelNotFoundError, TokenOutOfRangeError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer:
    """Encodes and decodes text for one model. Immutable after construction.

    `vocab_size` counts the tokenizer's entries (added tokens included); the model's embedding
    table may be larger, which is the engine's concern. `special_token_ids` are the IDs that
    `decode(..., skip_special_tokens=True)` drops.
    """

    def __init__(
        self,
        hf_tokenizer: HFTokenizer,
        config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tokenizer = hf_tokenizer
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.bos_token_id = self._optional_id(self.bos_token)
        self.eos_token_id = self._optional_id(self.eos_token)
        add_bos = config.get("add_bos_token")
        self.add_bos_token: bool | None = add_bos if isinstance(add_bos, bool) else None
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: tuple[int, ...] = _eos_token_ids(self.eos_token_id, generation_config or {})
        self.special_token_ids: frozenset[int] = self._special_token_ids()
        self.chat_template = chat_template if chat_template is not None else _config_template(config)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Loads `tokenizer.json` and its side files from a model directory."""
        path = Path(model_dir)
        tokenizer_path = path / TOKENIZER_FILE
        if not tokenizer_path.is_file():
            raise ModelNotFoundError(f"no {TOKENIZER_FILE} in model directory {path}")
        try:
            hf_tokenizer = HFTokenizer.from_file(str(tokenizer_path))
        except Exception as exc:  # the Rust side raises a bare Exception on parse errors
            raise CorruptModelError(f"cannot parse {tokenizer_path}: {exc}") from exc
        config = _read_json(path / TOKENIZER_CONFIG_FILE) or {}
        generation_config = _read_json(path / GENERATION_CONFIG_FILE)
        template_path = path / CHAT_TEMPLATE_FILE
        chat_template = template_path.read_text(encoding="utf-8") if template_path.is_file() else None
        return cls(hf_tokenizer, config, generation_config, chat_template)

    def to_json(self) -> str:
        """The tokenizer as tokenizer.json text (what the grammar engine builds its own from)."""
        return str(self._tokenizer.to_str())

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token IDs for `text`. With `add_special_tokens`, the post-processor's tokens (and BOS
        when `add_bos_token` asks for it) are added; chat-template output must not use it."""
        token_ids: list[int] = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        if (
            add_special_tokens
            and self.add_bos_token
            and self.bos_token_id is not None
            and token_ids[:1] != [self.bos_token_id]
        ):
            token_ids.insert(0, self.bos_token_id)
        return token_ids

    def token_ends(self, text: str) -> list[int]:
        """Where each token of `encode(text)` ends in `text`, as a character offset."""
        return [end for _, end in self._tokenizer.encode(text, add_special_tokens=False).offsets]

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """The text for `token_ids`. Incomplete UTF-8 sequences decode to U+FFFD."""
        ids = list(token_ids)
        if skip_special_tokens:
            ids = [token_id for token_id in ids if token_id not in self.special_token_ids]
        text: str = self._tokenizer.decode(ids, skip_special_tokens=False)
        return text

    def convert_ids_to_tokens(self, token_ids: Iterable[int]) -> list[str]:
        """The vocabulary entries for `token_ids`; raises TokenOutOfRangeError for an unknown ID."""
        tokens = []
        for token_id in token_ids:
            token = self._tokenizer.id_to_token(token_id)
            if token is None:
                raise TokenOutOfRangeError(token_id, self.vocab_size)
            tokens.append(token)
        return tokens

    def token_to_id(self, token: str) -> int | None:
        """The ID of a vocabulary entry, or None when it is not in the vocabulary."""
        token_id: int | None = self._tokenizer.token_to_id(token)
        return token_id

    def _optional_id(self, token: str | None) -> int | None:
        return None if token is None else self.token_to_id(token)

    def _special_token_ids(self) -> frozenset[int]:
        added = self._tokenizer.get_added_tokens_decoder()
        ids = {token_id for token_id, added_token in added.items() if added_token.special}
        named = (self.bos_token, self.eos_token, self.pad_token, self.unk_token)
        ids.update(token_id for token_id in map(self._optional_id, named) if token_id is not None)
        return frozenset(ids)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptModelError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise CorruptModelError(f"{path} does not hold a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or a serialized AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        content: str = value["content"]
        return content
    return None


def _eos_token_ids(config_eos_id: int | None, generation_config: dict[str, Any]) -> tuple[int, ...]:
    """EOS from the tokenizer config, then generation_config's (an int or a list), deduplicated."""
    extra = generation_config.get("eos_token_id")
    candidates: Sequence[Any] = extra if isinstance(extra, list) else [extra]
    ids = [config_eos_id, *candidates]
    valid = (token_id for token_id in ids if isinstance(token_id, int) and not isinstance(token_id, bool))
    return tuple(dict.fromkeys(valid))


def _config_template(config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's `chat_template`: a string, or a list of {name, template} (take "default")."""
    template = config.get("chat_template")
    if isinstance(template, str):
        return template
    if isinstance(template, list):
        for entry in template:
            if isinstance(entry, dict) and entry.get("name") == "default":
                default = entry.get("template")
                return default if isinstance(default, str) else None
    return None
