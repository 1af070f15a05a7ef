"""llguidance is optional: a process without it (a GPU image may lack it) starts and serves, and refuses
structured output with a GrammarError (a 400) naming what is missing, holding nothing for the refusal."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from services.common.errors import InvalidRequestError
from services.common.grammar import (
    GrammarCompiler,
    GrammarError,
    GrammarKind,
    GrammarSpec,
    GrammarUnavailableError,
)
from services.common.sampling import SamplingParams
from services.engine.layers.grammar_matchers import GrammarMatchers
from tests.engine_fakes import make_fake_engine

REGEX = GrammarSpec(GrammarKind.REGEX, "a+")


@pytest.fixture
def without_llguidance(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in sys.modules if n == "llguidance" or n.startswith("llguidance.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError


@pytest.mark.usefixtures("without_llguidance")
def test_an_engine_without_the_grammar_engine_serves_and_refuses_grammars(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_text("{}")
    core = make_fake_engine()
    core.grammars = GrammarMatchers(tokenizer, (2,), 128)
    why = core.prepare_grammars()
    assert why is not None and "llguidance" in why
    with pytest.raises(GrammarError, match="llguidance is not installed"):
        core.add_request("constrained", [5, 6, 7], SamplingParams(max_tokens=4, grammar=REGEX))
    assert not core.has_work()
    core.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    tokens = [t for _ in range(16) if core.has_work() for o in core.step() for t in o.new_token_ids]
    assert len(tokens) == 4 and not core.has_work()
    blocks = core.stats().kv_blocks
    assert blocks.num_active == 0


@pytest.mark.usefixtures("without_llguidance")
def test_the_codec_refuses_a_constraint_with_a_400_without_the_grammar_engine() -> None:
    with pytest.raises(GrammarUnavailableError, match="not installed") as refused:
        GrammarCompiler("{}", [2])
    assert isinstance(refused.value, InvalidRequestError)
