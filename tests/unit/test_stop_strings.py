"""StopStringMatcher: streamed text in, safe text out, checked against a brute-force reference."""

from __future__ import annotations

import itertools
import random

import pytest

from services.codec.text.stop_strings import StopResult, StopStringMatcher
from services.common.errors import InvalidRequestError


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Reads `text` one character at a time and stops at the first completed stop string."""
    for end in range(1, len(text) + 1):
        completed = [s for s in stops if text[:end].endswith(s)]
        if completed:
            stop = max(completed, key=len)
            return text[: end - len(stop)], stop
    return text, None


def longest_stop_prefix_suffix(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string (by brute force)."""
    lengths = [n for s in stops for n in range(len(s)) if n <= len(text) and text[len(text) - n :] == s[:n]]
    return max(lengths, default=0)


def stream(stops: list[str], chunks: list[str]) -> tuple[str, str | None, list[str]]:
    """Feeds `chunks` to a matcher; returns (emitted text, matched stop, per-push emitted texts)."""
    matcher = StopStringMatcher(stops)
    emitted: list[str] = []
    for chunk in chunks:
        result = matcher.push(chunk)
        emitted.append(result.text)
        if result.stop is not None:
            return "".join(emitted), result.stop, emitted
    emitted.append(matcher.flush())
    return "".join(emitted), None, emitted


def random_chunks(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1))) if len(text) > 1 else []
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def test_matches_brute_force_reference_on_random_texts_and_chunkings() -> None:
    rng = random.Random(1234)
    alphabet = "abc"
    for _ in range(3000):
        stops = ["".join(rng.choices(alphabet, k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 30)))
        emitted, stop, _ = stream(stops, random_chunks(rng, text))
        assert (emitted, stop) == reference_stop(text, stops), (text, stops)


def test_matches_across_push_boundaries() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.push("The answer is 4</an") == StopResult("The answer is 4")
    assert matcher.push("swer> and more") == StopResult("", "</answer>")
    assert matcher.is_stopped
    assert matcher.matched_stop == "</answer>"


def test_holds_back_only_a_possible_stop_prefix() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("hello S").text == "hello "
    assert matcher.push("x").text == "Sx"
    assert matcher.push("ST").text == ""
    assert matcher.flush() == "ST"


def test_text_without_stop_prefix_streams_immediately() -> None:
    matcher = StopStringMatcher(["\n\n", "###"])
    assert matcher.push("plain words") == StopResult("plain words")


def test_holds_back_exactly_the_longest_possible_stop_prefix() -> None:
    rng = random.Random(99)
    for _ in range(1000):
        stops = ["".join(rng.choices("ab", k=rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choices("ab", k=rng.randint(1, 20)))
        matcher = StopStringMatcher(stops)
        seen, emitted = "", ""
        for chunk in random_chunks(rng, text):
            result = matcher.push(chunk)
            seen += chunk
            emitted += result.text
            if result.stop is not None:
                break
            held = longest_stop_prefix_suffix(seen, stops)
            assert emitted == seen[: len(seen) - held], (text, stops)


def test_earliest_completed_stop_wins() -> None:
    emitted, stop, _ = stream(["bc", "abcd"], ["ab", "cd"])
    assert (emitted, stop) == ("a", "bc")


def test_longest_stop_wins_when_two_end_together() -> None:
    emitted, stop, _ = stream(["c", "abc"], ["xab", "c"])
    assert (emitted, stop) == ("x", "abc")


def test_no_stop_strings_passes_text_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.push("anything") == StopResult("anything")
    assert matcher.flush() == ""


def test_input_after_stop_is_discarded() -> None:
    matcher = StopStringMatcher(["x"])
    assert matcher.push("ax") == StopResult("a", "x")
    assert matcher.push("more") == StopResult("")
    assert matcher.flush() == ""


def test_multibyte_text_and_stop_strings() -> None:
    emitted, stop, _ = stream(["。終"], ["こんにちは。", "終わり"])
    assert (emitted, stop) == ("こんにちは", "。終")


@pytest.mark.parametrize("stops", [[""], ["ok", ""]])
def test_rejects_empty_stop_string(stops: list[str]) -> None:
    with pytest.raises(InvalidRequestError) as exc_info:
        StopStringMatcher(stops)
    assert exc_info.value.param == "stop"
