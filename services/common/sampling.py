"""Sampling parameters: the per-request knobs shared by the codec and the engine.

Torch-free on purpose: the codec builds and validates these, the engine's sampler consumes them.
Semantics (applied by services/engine/layers/sampler.py, in this order):

- `repetition_penalty` (HF/vLLM): every token seen in the prompt or the output so far has its logit
  divided by the penalty when positive and multiplied by it otherwise. 1.0 is off.
- `frequency_penalty` / `presence_penalty` (OpenAI): over output tokens only, a token's logit is
  lowered by `frequency_penalty * count + presence_penalty * (count > 0)`. 0.0 is off.
- `min_tokens`: the engine bans EOS and `stop_token_ids` until this many tokens are generated.
- `temperature` 0 (below 1e-5) is greedy: argmax of the penalised logits, filters ignored.
- `top_k` (0 is off), `top_p` (1.0 is off) and `min_p` (0.0 is off) filter, in that order.
- `seed` makes a request's tokens a function of (seed, output position) only.
- `logprobs` k returns the chosen token's logprob plus the k most likely tokens (k may be 0).
- `grammar` (structured output, services/common/grammar.py): only tokens that keep the output inside
  the grammar may be sampled; the mask applies after the bans, before greedy or filtered sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import InvalidSamplingError
from services.common.grammar import GrammarSpec

GREEDY_TEMPERATURE_EPS = 1e-5
MAX_TEMPERATURE = 100.0
MAX_N = 16
MAX_LOGPROBS = 20
MAX_PENALTY_MAGNITUDE = 2.0
SEED_LIMIT = 2**63
MAX_STOP_TOKEN_IDS = 128  # each is checked against every sampled token


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token of one request. Call `validate` before trusting the values."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    grammar: GrammarSpec | None = None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def has_penalties(self) -> bool:
        """True when sampling reads the tokens seen so far (repetition, frequency or presence)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidSamplingError, naming the parameter, for the first value out of range.

        With `vocab_size`, stop token IDs must also lie in [0, vocab_size).
        """
        _check_int("n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        _check_int("top_k", self.top_k, 0, None)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidSamplingError(
                f"repetition_penalty must be a positive number, got {self.repetition_penalty}",
                param="repetition_penalty",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            _check_float(name, getattr(self, name), -MAX_PENALTY_MAGNITUDE, MAX_PENALTY_MAGNITUDE)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, SEED_LIMIT - 1)
        _check_int("max_tokens", self.max_tokens, 1, None)
        _check_int("min_tokens", self.min_tokens, 0, None)
        if self.min_tokens > self.max_tokens:
            raise InvalidSamplingError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                param="min_tokens",
            )
        max_token_id = None if vocab_size is None else vocab_size - 1
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidSamplingError(
                f"stop_token_ids holds {len(self.stop_token_ids)} IDs; the limit is {MAX_STOP_TOKEN_IDS}",
                param="stop_token_ids",
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, max_token_id)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingError("ignore_eos must be a boolean", param="ignore_eos")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    """Require an int (not a bool) in [low, high]; `high` None means unbounded."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingError(f"{name} must be an integer, got {value!r}", param=name)
    if value < low or (high is not None and value > high):
        upper = "∞)" if high is None else f"{high}]"
        raise InvalidSamplingError(f"{name} must be in [{low}, {upper}, got {value}", param=name)


def _check_number(name: str, value: object) -> float:
    """Require a finite int or float (not a bool) and return it: NaN and infinities are rejected."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidSamplingError(f"{name} must be a finite number, got {value!r}", param=name)
    return float(value)


def _check_float(name: str, value: object, low: float, high: float) -> None:
    """Require a finite number in [low, high]."""
    number = _check_number(name, value)
    if not low <= number <= high:
        raise InvalidSamplingError(f"{name} must be in [{low:g}, {high:g}], got {value}", param=name)
