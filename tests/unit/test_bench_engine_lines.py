"""`kvrelay bench engine`'s printed comparisons, from a result dict: each of our sides against llama.cpp
(the table's ratio column compares only the first side with the last) and against the bandwidth bound."""

from __future__ import annotations

from services.bench.engine import bound_line, peer_line, side_name, sides_line, table

RESULT = {
    "sides": ["kvrelay-safetensors", "kvrelay-gguf-int8", "llama.cpp"],
    "kvrelay-safetensors": {"prefill_tok_s": 849.0, "decode": {"1": {"tok_s": 34.5, "ttft_ms": 56.0}}},
    "kvrelay-gguf-int8": {
        "prefill_tok_s": 408.0,
        "decode": {"1": {"tok_s": 157.7, "ttft_ms": 76.0}},
        "bound_tok_s": 331.0,
        "step_weight_bytes": 96_000_000,
    },
    "llama.cpp": {"prefill_tok_s": 285.0, "decode": {"1": {"tok_s": 123.1}}},
}


def test_each_side_is_compared_with_llama_cpp_not_only_the_first() -> None:
    assert peer_line("kvrelay-gguf-int8", RESULT["kvrelay-gguf-int8"], RESULT["llama.cpp"]) == (
        "kvrelay-gguf-int8 / llama.cpp: prefill 1.43x, decode @1 1.28x"
    )
    assert peer_line("kvrelay-safetensors", RESULT["kvrelay-safetensors"], RESULT["llama.cpp"]) == (
        "kvrelay-safetensors / llama.cpp: prefill 2.98x, decode @1 0.28x"
    )
    _, rows = table(RESULT, [1])
    assert rows[1][-1] == "0.28x"  # the column: first side over last


def test_a_side_without_batch_1_says_so() -> None:
    side = {"prefill_tok_s": 400.0, "decode": {"32": {"tok_s": 340.0}}}
    assert peer_line("kvrelay", side, RESULT["llama.cpp"]).endswith("decode @1 n/a (no batch 1 measured)")


def test_the_bound_line_gives_the_share_of_the_bandwidth_bound() -> None:
    line = bound_line("kvrelay-gguf-int8", RESULT["kvrelay-gguf-int8"], 1, 31.8)
    assert line.startswith("kvrelay-gguf-int8: decode @1 157.7 tok/s = 48% of the bound 331 tok/s")
    assert line.endswith("(31.8 GB/s read, 96 MB of weights a step)")


def test_side_names_carry_only_what_the_run_varies() -> None:
    assert side_name("auto", "auto", 1, 1) == "kvrelay"
    assert side_name("gguf-int8", "auto", 2, 1) == "kvrelay-gguf-int8"
    assert side_name("gguf-int8", "float32", 1, 2) == "kvrelay-gguf-int8-kv-float32"
    assert side_name("auto", "auto", 1, 1, "deterministic") == "kvrelay-deterministic"


def test_sides_compare_by_the_median_of_ratios_taken_within_each_round() -> None:
    def side(*rounds: tuple[float, float]) -> dict[str, object]:
        return {"rounds": [{"prefill_tok_s": p, "decode": {"1": {"tok_s": d}}} for p, d in rounds]}

    # round 2 ran on a machine half as fast for both sides: each within-round ratio stays 2x at batch 1
    result = {"a": side((100, 40), (50, 20), (100, 44)), "b": side((100, 20), (50, 10), (125, 20))}
    line = sides_line("a", "b", result, [1])
    assert line == (
        "a / b, medians of within-round ratios: prefill 1.00x (0.80-1.00), decode @1 2.00x (2.00-2.20)"
    )
