"""Structured output on the engine side: one grammar matcher per sample, for the model's tokenizer. No torch.

The compiler (services/common/grammar.py) is built from the model directory's tokenizer.json the first
time it is needed: building llguidance's tokenizer takes ~0.4 s for a 49k vocabulary, so an engine that
never sees a grammar (tests, benchmarks, `kvrelay generate`) never pays it, and a worker pays it before it
serves (`prepare`), not on its first grammar request. Its vocabulary is the logits' width (the model's
`vocab_size`), so rows past the tokenizer's last token are never allowed, and its end-of-sequence tokens
are the engine's. A model the compiler cannot be built for (no tokenizer.json, a tokenizer llguidance does
not read) still serves; its grammar requests are refused with a GrammarError (a 400). So does a process
without llguidance installed (a GPU image may lack it): nothing here imports it until a grammar is needed.

A matcher follows one sample's output tokens: `Request.append_token` / `resolve_token` feed it each sampled
token once, the runner reads the next allowed tokens from it (grammar_mask.py), and `Request.check_stop`
ends the sample once the grammar is complete.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from services.common.grammar import GrammarCompiler, GrammarError, GrammarSpec, GrammarUnavailableError

if TYPE_CHECKING:
    import llguidance


class GrammarMatchers:
    """Makes the matchers of a request's samples. Thread-safe: `prepare` may run on another thread."""

    def __init__(self, tokenizer_path: Path, eos_token_ids: Sequence[int], vocab_size: int) -> None:
        self.tokenizer_path = tokenizer_path
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self._lock = threading.Lock()
        self._compiler: GrammarCompiler | None = None
        self._unavailable: str | None = None  # why the compiler cannot be built, once tried

    def prepare(self) -> bool:
        """Build the compiler now (once); False when this model cannot have one (see `unavailable`)."""
        return self._get_compiler() is not None

    @property
    def unavailable(self) -> str | None:
        """Why grammars are refused here, or None (also before the first try)."""
        return self._unavailable

    def matchers(self, spec: GrammarSpec, n: int) -> list[llguidance.LLMatcher]:
        """`n` fresh matchers at the start of `spec`: GrammarError when it does not compile or this model
        has no compiler."""
        compiler = self._get_compiler()
        if compiler is None:
            raise GrammarError(f"structured output is not available for this model: {self._unavailable}")
        first = compiler.matcher(spec)
        return [first, *(first.deep_copy() for _ in range(n - 1))]

    def _get_compiler(self) -> GrammarCompiler | None:
        with self._lock:
            if self._compiler is None and self._unavailable is None:
                try:
                    text = self.tokenizer_path.read_text(encoding="utf-8")
                    self._compiler = GrammarCompiler(text, self.eos_token_ids, self.vocab_size)
                except (GrammarUnavailableError, OSError, ValueError, RuntimeError) as exc:
                    self._unavailable = f"{type(exc).__name__}: {exc}"
            return self._compiler
