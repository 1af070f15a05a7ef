"""IncrementalDetokenizer: streamed deltas join to exactly `decode(all output IDs)`."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, normalizers
from tokenizers.models import BPE

from services.codec.text.detokenizer import IncrementalDetokenizer
from services.codec.text.tokenizer import Tokenizer

MULTIBYTE_TEXTS = [
    "Hello, world! 👋🏽 Family: 👨‍👩‍👧‍👦 done.",
    "日本語のテキストと中文文本，还有한국어도 있어요。",
    "Crème brûlée, naïve façade, Ångström, Dvořák, İstanbul.",
    "Math: ∀x ∈ ℝ, x² ≥ 0 — “quotes” and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 🧪🚀",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
]


def stream(
    detokenizer: IncrementalDetokenizer, token_ids: Sequence[int], rng: random.Random | None = None
) -> list[str]:
    """Pushes `token_ids` one at a time (or in random chunks of 1-4) and returns every delta, flush last."""
    deltas: list[str] = []
    position = 0
    while position < len(token_ids):
        size = rng.randint(1, 4) if rng is not None else 1
        deltas.append(detokenizer.push(token_ids[position : position + size]))
        position += size
    deltas.append(detokenizer.flush())
    return deltas


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.mark.model
@pytest.mark.parametrize("text", MULTIBYTE_TEXTS)
def test_multibyte_text_streams_without_broken_characters(tokenizer: Tokenizer, text: str) -> None:
    token_ids = tokenizer.encode(text)
    prompt_ids = tokenizer.encode("Say something:")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids), token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids) == text
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.model
def test_an_emoji_spans_several_tokens_and_is_held_until_complete(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode("🧪")
    assert len(token_ids) > 1, "the test needs a character split across tokens"
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push([token_id]) for token_id in token_ids]
    assert deltas[:-1] == [""] * (len(token_ids) - 1)
    assert deltas[-1] == "🧪"


@pytest.mark.model
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_token_streams_join_to_full_decode(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(7)
    special_ids = sorted(tokenizer.special_token_ids)
    for _ in range(300):
        num_tokens = rng.randint(0, 40)
        output_ids = [
            rng.choice(special_ids) if rng.random() < 0.05 else rng.randrange(tokenizer.vocab_size)
            for _ in range(num_tokens)
        ]
        prompt_ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 10))]
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        deltas = stream(detokenizer, output_ids, rng)
        assert "".join(deltas) == tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.model
def test_prompt_ending_inside_a_character_does_not_leak_into_output(tokenizer: Tokenizer) -> None:
    emoji_ids = tokenizer.encode("🚀")
    prompt_ids = tokenizer.encode("Go") + emoji_ids[:1]  # the prompt ends mid-character
    output_ids = emoji_ids[1:] + tokenizer.encode(" now")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids), output_ids)
    assert "".join(deltas) == tokenizer.decode(output_ids)


@pytest.mark.model
def test_special_tokens_are_skipped_or_kept(tokenizer: Tokenizer) -> None:
    eos_id = tokenizer.eos_token_ids[0]
    token_ids = [*tokenizer.encode("Paris"), eos_id]
    skipped = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=True), token_ids)
    kept = stream(IncrementalDetokenizer(tokenizer, skip_special_tokens=False), token_ids)
    assert "".join(skipped) == "Paris"
    assert "".join(kept) == "Paris" + (tokenizer.eos_token or "")


@pytest.mark.model
def test_each_push_decodes_a_short_window(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    window_lens: list[int] = []
    decode = tokenizer.decode

    def spy(token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        window_lens.append(len(token_ids))
        return decode(token_ids, skip_special_tokens=skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", spy)
    text = " ".join(MULTIBYTE_TEXTS) * 20
    token_ids = tokenizer.encode(text)
    deltas = stream(IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt:")), token_ids)
    monkeypatch.undo()
    assert "".join(deltas) == text
    assert len(token_ids) > 1000
    assert max(window_lens) <= 16


def write_byte_fallback_model(path: Path) -> Path:
    """A SentencePiece-style tokenizer (Llama 2 layout) whose CJK and emoji use <0xXX> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    for piece in ["▁", "h", "i", "▁h", "▁hi", "o", "k", "▁o", "▁ok", "é"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "i"), ("▁", "o"), ("▁o", "k")]
    hf = HFTokenizer(BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    hf.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    hf.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    hf.add_special_tokens(["<unk>", "<s>", "</s>"])
    hf.save(str(path / "tokenizer.json"))
    return path


def test_byte_fallback_tokens_stream_whole_characters(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_fallback_model(tmp_path))
    text = "hi 日本 ok 👍 é hi"
    token_ids = tokenizer.encode(text)
    assert tokenizer.convert_ids_to_tokens(token_ids).count("<0xF0>") == 1
    deltas = stream(IncrementalDetokenizer(tokenizer), token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_prompt_context_keeps_the_leading_space_sentencepiece_strips(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_byte_fallback_model(tmp_path))
    prompt_ids, output_ids = tokenizer.encode("ok"), tokenizer.encode("hi 日本")
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids), output_ids)
    full_text = tokenizer.decode(prompt_ids + output_ids)
    assert "".join(deltas) == full_text.removeprefix(tokenizer.decode(prompt_ids)) == " hi 日本"
    assert not any("\ufffd" in delta for delta in deltas)
