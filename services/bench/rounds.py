"""Interleaved rounds for `kvrelay bench engine --rounds N`: every side measured once per round, in turn.

A shared VM's speed drifts by tens of percent within minutes, so one side measured after another can
differ by more than the sides do. Taking turns round by round exposes each side to the same drift, and a
ratio taken within a round (ours against llama.cpp's, ours against the bound from that round's read
bandwidth) cancels what the whole machine did in that round. A side's result is the median of its rounds
(rates and TTFT; preemptions summed), with the rounds kept under "rounds"; the per-round ratios are
printed as a range next to the ratio of medians.
"""

from __future__ import annotations

from typing import Any

from services.bench.stats import median


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's result from its rounds (each {"prefill_tok_s", "decode": {batch: {metric: value}}}):
    each number the median over rounds, except preemptions, summed; the rounds themselves under "rounds"
    when there are two or more."""
    merged: dict[str, Any] = {"prefill_tok_s": median(r["prefill_tok_s"] for r in rounds), "decode": {}}
    for batch, first in rounds[0]["decode"].items():
        merged["decode"][batch] = {
            key: (sum if key == "preemptions" else median)(r["decode"][batch][key] for r in rounds)
            for key in first
        }
    if len(rounds) > 1:
        merged["rounds"] = rounds
    return merged


def decode_rates(side: dict[str, Any], batch: int) -> list[float]:
    """The side's decode tok/s at `batch` in each round (one value for a single round); [] if unmeasured."""
    rounds = side.get("rounds", [side])
    return [float(r["decode"][str(batch)]["tok_s"]) for r in rounds if str(batch) in r.get("decode", {})]


def ratio_range(numerators: list[float], denominators: list[float], fmt: str) -> str:
    """ ", rounds a–b" over the per-round ratios numerator / denominator, or "" for fewer than two rounds
    (a side or peer without a value in a round leaves the whole range out)."""
    if len(numerators) < 2 or len(numerators) != len(denominators) or not all(denominators):
        return ""
    ratios = [n / d for n, d in zip(numerators, denominators, strict=True)]
    return f", rounds {format(min(ratios), fmt)}-{format(max(ratios), fmt)}"
