"""`kvrelay bench engine --rounds N`: a side's numbers are medians over its rounds, and the printed ratios
add the range of the ratios taken within each round (services/bench/rounds.py)."""

from __future__ import annotations

from typing import Any

from services.bench.engine import bound_line, peer_line
from services.bench.rounds import decode_rates, merge_rounds, ratio_range


def a_round(prefill: float, rate: float, preemptions: int = 0) -> dict[str, Any]:
    return {
        "prefill_tok_s": prefill,
        "decode": {"1": {"tok_s": rate, "ttft_ms": 10.0, "preemptions": preemptions}},
    }


def test_a_side_is_the_median_of_its_rounds_and_keeps_them() -> None:
    rounds = [a_round(400.0, 120.0, 1), a_round(300.0, 90.0), a_round(500.0, 150.0, 2)]
    merged = merge_rounds(rounds)
    assert merged["prefill_tok_s"] == 400.0
    assert merged["decode"]["1"] == {"tok_s": 120.0, "ttft_ms": 10.0, "preemptions": 3}
    assert merged["rounds"] == rounds
    assert decode_rates(merged, 1) == [120.0, 90.0, 150.0]
    assert decode_rates(merged, 8) == []


def test_one_round_is_the_side_as_measured() -> None:
    merged = merge_rounds([a_round(400.0, 120.0)])
    assert merged == {"prefill_tok_s": 400.0, "decode": a_round(400.0, 120.0)["decode"]}
    assert decode_rates(merged, 1) == [120.0]


def test_the_range_is_of_ratios_within_rounds_not_of_medians() -> None:
    # the machine halves its speed in round 2: both sides slow down together, the paired ratio stays 1.2-1.25
    assert ratio_range([120.0, 60.0], [100.0, 48.0], ".2f") == ", rounds 1.20-1.25"
    assert ratio_range([120.0], [100.0], ".2f") == ""  # one round: no range
    assert ratio_range([120.0, 60.0], [100.0], ".2f") == ""  # the peer missed a round
    assert ratio_range([120.0, 60.0], [100.0, 0.0], ".2f") == ""


def test_peer_and_bound_lines_carry_the_per_round_range() -> None:
    ours = merge_rounds([a_round(400.0, 120.0), a_round(200.0, 60.0), a_round(420.0, 130.0)])
    ours |= {"bound_tok_s": 300.0, "step_weight_bytes": 100_000_000}
    peer = merge_rounds([a_round(200.0, 100.0), a_round(100.0, 50.0), a_round(200.0, 100.0)])
    assert peer_line("kvrelay", ours, peer) == (
        "kvrelay / llama.cpp: prefill 2.00x, rounds 2.00-2.10, decode @1 1.20x, rounds 1.20-1.30"
    )
    line = bound_line("kvrelay", ours, 1, 30.0, [30.0, 15.0, 26.0])  # bounds 300, 150, 260 tok/s
    assert line == (
        "kvrelay: decode @1 120.0 tok/s = 40% of the bound 300 tok/s "
        "(30.0 GB/s read, 100 MB of weights a step, rounds 40%-50%)"
    )
