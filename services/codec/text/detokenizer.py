"""Streaming detokenization: token IDs in, stable text deltas out, one small window per step.

The detokenizer keeps a short window of token IDs and two offsets into it (the scheme from TGI
and vLLM's slow path):

    window:  [ prefix tokens | read tokens | pending tokens ]
              ^0              ^read_index
    prefix_text = decode(window[:read_index])    (cached)
    new_text    = decode(window)

The prefix tokens give the tokenizer left context (space handling, byte merges). Each push
decodes the window; if `new_text` is longer than `prefix_text` and does not end in U+FFFD (an
incomplete UTF-8 character), the extra text is emitted and the window slides: the old read
tokens become the new prefix. Otherwise everything is held until more tokens arrive. The window
stays a few tokens long, so a step costs O(1) in the output length.

Skipped special tokens decode to nothing, so they never enter the window. A U+FFFD in the middle
of the text is a genuine model output and is emitted once a later token follows it. (A run of
invalid bytes at the end keeps the window growing until a valid character or `flush` ends it.)
"""

from __future__ import annotations

from collections.abc import Sequence

from services.codec.text.tokenizer import Tokenizer

# Prompt tokens kept as left context for the first output tokens (vLLM uses 5).
NUM_CONTEXT_TOKENS = 5

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's output token IDs into text deltas.

    For byte-level BPE tokenizers (SmolLM2, Llama 3, Qwen) the deltas joined together equal
    `tokenizer.decode(output_ids, skip_special_tokens=...)`. For tokenizers that strip a leading
    space at the start of a decode (SentencePiece), the prompt context keeps that space, as a
    streaming client expects.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = self._context(prompt_token_ids)
        self._read_index = len(self._window)
        self._prefix_text = self._decode(self._window)

    def push(self, token_ids: Sequence[int]) -> str:
        """Adds output tokens and returns the text that became stable ("" while holding back)."""
        kept = [token_id for token_id in token_ids if not self._is_skipped(token_id)]
        if not kept:
            return ""
        self._window.extend(kept)
        new_text = self._decode(self._window)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._window = self._window[self._read_index :]
        self._read_index = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def flush(self) -> str:
        """Returns whatever is held back (e.g. an incomplete character at the end). Call once, last."""
        pending = self._decode(self._window)[len(self._prefix_text) :]
        self._window = self._window[self._read_index :]
        self._read_index = len(self._window)
        self._prefix_text = self._decode(self._window)
        return pending

    def _context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last tokens, or none when they end inside a character: those bytes would
        merge with the first output bytes and change how the output decodes."""
        context = [token_id for token_id in prompt_token_ids if not self._is_skipped(token_id)]
        context = context[-NUM_CONTEXT_TOKENS:]
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _is_skipped(self, token_id: int) -> bool:
        return self._skip_special_tokens and token_id in self._tokenizer.special_token_ids

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=False)
