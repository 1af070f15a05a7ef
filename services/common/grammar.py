"""Structured output: the constraint a request's tokens must follow, as it crosses the token boundary.

The codec turns each protocol's field (OpenAI `response_format`, Responses `text.format`, Anthropic
`output_config.format`, vLLM's `structured_outputs` / `guided_*` extras) into a `GrammarSpec`: what kind
of constraint and its source text, never a compiled object, so the codec and the workers share no state
but the tokenizer (their fingerprints already agree, or the codec refuses to serve). Both compile it with
`GrammarCompiler` against that tokenizer: the codec once, off the event loop, to refuse a constraint that
cannot compile with a 400 before anything is queued; each worker again (a cache hit for a popular
schema) to make the matchers that mask the logits.

The grammar engine is llguidance (MIT, a Rust core with no torch or transformers dependency, so the
torch-free codec can compile too; masks in ~50 µs per step for a 50k vocabulary; JSON schema, regex, Lark
and its own JSON grammar format; recursive `$ref` supported). xgrammar needs torch and transformers at
import, which the codec must not load; outlines-core has no context-free grammars, so no recursive schemas.

JSON is generated compact (no whitespace between tokens outside strings): fewer tokens, and a small model
cannot wander into whitespace forever. `strict` (OpenAI's `strict: true`) refuses schema keywords the
grammar engine does not implement instead of ignoring them.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import ModuleType
from typing import TYPE_CHECKING, Any

from services.common.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance

MAX_SPEC_CHARS = 256 * 1024  # a schema or grammar's source text; bodies are capped at 4 MiB anyway
MAX_CHOICES = 1024
CACHE_SIZE = 256  # compiled grammars kept per compiler, by spec key


class GrammarKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # text: the schema, as JSON
    JSON_OBJECT = "json_object"  # text: "" (any JSON object)
    REGEX = "regex"  # text: the pattern (Rust regex syntax, anchored at both ends)
    CHOICE = "choice"  # text: a JSON array of the allowed strings
    LARK = "lark"  # text: a Lark grammar (llguidance's dialect; `start` is the start rule)


class GrammarError(InvalidRequestError):
    """A constraint that cannot compile: a 400 naming the request field it came from."""


class GrammarUnavailableError(GrammarError):
    """The grammar engine is not installed in this process: constraints are refused (a 400), and
    everything else still serves. A GPU image may leave llguidance out."""


def grammar_engine() -> ModuleType:
    """llguidance, imported on first use so that a process without it starts and serves unconstrained
    requests; GrammarUnavailableError when it is not installed."""
    try:
        import llguidance
    except ImportError as exc:
        raise GrammarUnavailableError(
            f"structured output is not available here: the grammar engine llguidance is not installed ({exc})"
        ) from None
    return llguidance


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    text: str = ""
    strict: bool = False

    @property
    def key(self) -> str:
        """What two equal constraints share: the compile cache's key."""
        digest = hashlib.sha256(
            f"{self.kind}\0{int(self.strict)}\0{self.text}".encode("utf-8", "surrogatepass")
        )
        return digest.hexdigest()

    @classmethod
    def json_schema(cls, schema: Any, *, strict: bool = False) -> GrammarSpec:
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema, separators=(",", ":"), sort_keys=True), strict)

    @classmethod
    def choice(cls, choices: Sequence[str]) -> GrammarSpec:
        return cls(GrammarKind.CHOICE, json.dumps(list(choices), ensure_ascii=False))


@dataclass(frozen=True)
class Constraint:
    """A request's structured output constraint and the request field that named it (a 400's `param`)."""

    spec: GrammarSpec
    param: str


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar for `spec`; GrammarError for what is wrong with it before compiling."""
    if len(spec.text) > MAX_SPEC_CHARS:
        raise GrammarError(f"the {spec.kind} is {len(spec.text)} characters; the limit is {MAX_SPEC_CHARS}")
    engine = grammar_engine()
    options: dict[str, Any] = {"whitespace_flexible": False, "lenient": not spec.strict}
    if spec.kind is GrammarKind.JSON_OBJECT:
        return str(engine.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options))
    if spec.kind is GrammarKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec.text)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be an object")
        try:
            return str(engine.LLMatcher.grammar_from_json_schema(schema, defaults=options))
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is invalid: {exc}") from None
    if spec.kind is GrammarKind.REGEX:
        return str(engine.LLMatcher.grammar_from_regex(spec.text))
    if spec.kind is GrammarKind.CHOICE:
        return str(engine.LLMatcher.grammar_from_lark(_choice_lark(spec.text)))
    return str(engine.LLMatcher.grammar_from_lark(spec.text))


def _choice_lark(text: str) -> str:
    try:
        choices = json.loads(text)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("choice must be a non-empty list of non-empty strings")
    if len(choices) > MAX_CHOICES:
        raise GrammarError(f"choice holds {len(choices)} strings; the limit is {MAX_CHOICES}")
    return "start: " + " | ".join(json.dumps(choice) for choice in choices)


class GrammarCompiler:
    """Compiles specs against one tokenizer and makes matchers; compiled grammars are cached by spec key.
    Thread-safe: the codec compiles in its prompt pool, a worker on its engine thread."""

    def __init__(
        self, tokenizer_json: str, eos_token_ids: Sequence[int], vocab_size: int | None = None
    ) -> None:
        """`tokenizer_json`: the Hugging Face tokenizer.json text; `vocab_size`: the logits' width when it is
        wider than the tokenizer's (padded rows), so masks cover it. GrammarUnavailableError without
        llguidance."""
        self._engine = grammar_engine()
        self.tokenizer = self._engine.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None
        )
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, str] = OrderedDict()

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    def compile(self, spec: GrammarSpec) -> str:
        """The checked grammar for `spec` (cached); GrammarError with the engine's message when it fails."""
        with self._lock:
            if spec.key in self._compiled:
                self._compiled.move_to_end(spec.key)
                return self._compiled[spec.key]
        grammar = grammar_source(spec)
        is_error, messages = self._engine.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise GrammarError(f"the {spec.kind} does not compile: {_first_line(messages)}")
        if spec.strict and messages:  # an unsupported keyword is a warning when lenient, an error strict
            raise GrammarError(f"the {spec.kind} is not supported in strict mode: {_first_line(messages)}")
        with self._lock:
            self._compiled[spec.key] = grammar
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return grammar

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A fresh matcher at the start of `spec` (one per sample)."""
        matcher = self._engine.LLMatcher(self.tokenizer, self.compile(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind} does not compile: {_first_line([matcher.get_error()])}")
        return matcher


def _first_line(messages: Sequence[str]) -> str:
    """The engine's messages on one line, at most 500 characters."""
    text = " ".join(" ".join(m.split()) for m in messages)
    return text[:500] or "no reason given"
