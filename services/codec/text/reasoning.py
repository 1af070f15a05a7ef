"""Reasoning: a model's thinking block, kept apart from its answer, and its token budget.

A template has a thinking mode when it writes `<think>` (Qwen3's, DeepSeek-R1's, the one in
tests/fixtures/qwen3_think.jinja). With thinking on, the template ends the prompt inside an open
`<think>` block or the model opens one itself; `ReasoningParser` splits the streamed text at the markers
into reasoning and answer. With thinking off the template writes an empty block into the prompt and the
output is all answer.

The budget is enforced by the grammar engine: `thinking_grammar` wraps the answer's own constraint (a
tool call, a JSON schema, or none) after a thinking block limited to `budget` tokens, so at the budget the
only token the model may take is the one that closes the block, and a forced call or a schema starts only
after the thinking ends.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from services.codec.text.stop_strings import partial_match_len
from services.common.errors import InvalidRequestError
from services.common.grammar import GrammarKind, GrammarSpec

START = "<think>"
END = "</think>"
ANY_TEXT = "/(?s:.*)/"


@dataclass(frozen=True)
class Thinking:
    """A request's wish to think: on or off, and at most `budget` tokens of it."""

    enabled: bool
    budget: int | None = None


@dataclass(frozen=True)
class ReasoningPiece:
    text: str


@dataclass(frozen=True)
class AnswerPiece:
    text: str


def template_has_thinking(template_source: str) -> bool:
    return START in template_source and END in template_source


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves a thinking block open for the model to continue."""
    tail = prompt_text.rstrip()
    return tail.endswith(START)


class ReasoningParser:
    """Splits one sample's text into reasoning and answer. `opened`: the prompt already opened the block;
    otherwise a block counts only when the output starts with it (after whitespace)."""

    def __init__(self, *, opened: bool) -> None:
        self._in_reasoning = opened
        self._may_open = not opened  # the output's start is still undecided
        self._held = ""
        self._done = False  # the block is closed: everything else is answer
        self._answer_started = False

    def push(self, text: str) -> list[ReasoningPiece | AnswerPiece]:
        if self._done:
            if self._answer_started:
                return [AnswerPiece(text)] if text else []
            text = text.lstrip("\n")  # the blank lines after the block are no part of the answer
            self._answer_started = bool(text)
            return [AnswerPiece(text)] if text else []
        self._held += text
        pieces: list[ReasoningPiece | AnswerPiece] = []
        if self._may_open:
            stripped = self._held.lstrip()
            if stripped.startswith(START):
                self._held = stripped[len(START) :]
                self._in_reasoning = True
                self._may_open = False
            elif START.startswith(stripped):
                return pieces  # still could be the marker
            else:
                self._may_open = False
                self._done = self._answer_started = True
                text, self._held = self._held, ""
                return [AnswerPiece(text)]
        at = self._held.find(END)
        if at >= 0:
            if at:
                pieces.append(ReasoningPiece(self._held[:at]))
            rest = self._held[at + len(END) :]
            self._held = ""
            self._done = True
            return pieces + self.push(rest)
        keep = partial_match_len(self._held, (END,))
        if len(self._held) > keep:
            pieces.append(ReasoningPiece(self._held[: len(self._held) - keep]))
            self._held = self._held[len(self._held) - keep :]
        return pieces

    def finish(self) -> list[ReasoningPiece | AnswerPiece]:
        held, self._held = self._held, ""
        if not held:
            return []
        return [ReasoningPiece(held)] if self._in_reasoning and not self._done else [AnswerPiece(held)]


def thinking_grammar(
    answer: GrammarSpec | None,
    budget: int | None,
    *,
    opened: bool,
    start_id: int | None = None,
    end_id: int | None = None,
) -> GrammarSpec | None:
    """The constraint for a thinking request: the block (within `budget` tokens), then `answer`'s.
    `start_id`/`end_id`: the markers' token IDs where each is one token of the vocabulary (the grammar
    engine matches such a token only by its ID, never by its text). Where `</think>` is text (no real
    thinking model: the tests' template over SmolLM2's vocabulary), the thinking text may not hold `<`:
    the grammar engine's lexer does not backtrack, so a thinking lexeme that could hold `</think`
    would swallow the marker's start."""
    if answer is None and budget is None:
        return None
    end = f"<[{end_id}]>" if end_id is not None else json.dumps(END)
    start = "" if opened else (f"<[{start_id}]> " if start_id is not None else json.dumps(START) + " ")
    limit = f"[max_tokens={budget}]" if budget is not None else ""
    gap = "" if answer is None else " GAP?"  # the blank lines a model writes after the block
    lines = [
        f"start: {start}thinking {end}{gap} answer",
        f"thinking{limit}: THINKING",
        f"THINKING: /(?s:.*)/ & ~/(?s:.*{_escaped(END)}.*)/" if end_id is not None else "THINKING: /[^<]*/",
        "GAP: /\\n{1,2}/",  # bounded: a model must not wander in whitespace
    ]
    lines += _answer_rules(answer)
    return GrammarSpec(GrammarKind.LARK, "\n".join(lines))


def _answer_rules(answer: GrammarSpec | None) -> list[str]:
    if answer is None:
        return [f"answer: {ANY_TEXT}"]
    if answer.kind is GrammarKind.JSON_OBJECT:
        return ['answer: %json {"type": "object"}']
    if answer.kind is GrammarKind.JSON_SCHEMA:
        return [f"answer: %json {answer.text}"]
    if answer.kind is GrammarKind.REGEX:
        return [f"answer: /{answer.text.replace('/', chr(92) + '/')}/"]
    if answer.kind is GrammarKind.CHOICE:
        choices = json.loads(answer.text)
        return ["answer: " + " | ".join(json.dumps(choice) for choice in choices)]
    if answer.text.startswith("start: calls"):  # a tool grammar (tool_calls.CallFormat): start renamed
        first, rest = answer.text.split("\n", 1)
        return ["answer:" + first[len("start:") :], rest]
    raise InvalidRequestError("a Lark grammar cannot follow a thinking block; turn thinking off", "thinking")


def _escaped(text: str) -> str:
    return "".join("\\" + char if char in r"\/.*+?()[]{}|^$" else char for char in text)
