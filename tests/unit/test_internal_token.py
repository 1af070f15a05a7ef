"""The internal token (services/common/grpc_auth.py): refused at start when empty or short, a current
and a next token accepted together so rotation has no outage, and a file that later reads empty or
short not taken."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.errors import ConfigError
from services.common.grpc_auth import MIN_TOKEN_CHARS, TokenSource
from tests.stack_helpers import replace_file

OLD = "old-token-0123456789abcdef"
NEW = "new-token-0123456789abcdef"


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"KVRELAY_INTERNAL_TOKEN": "short"}, f"shorter than {MIN_TOKEN_CHARS}"),
        ({"KVRELAY_INTERNAL_TOKEN_FILE": "{empty}"}, "is empty"),
        ({"KVRELAY_INTERNAL_TOKEN_FILE": "{short_line}"}, "on line 2 is shorter"),
        ({}, "no internal token"),
    ],
)
def test_an_empty_or_short_token_is_refused_at_start(
    tmp_path: Path, env: dict[str, str], problem: str
) -> None:
    (tmp_path / "empty").write_text("\n  \n")
    (tmp_path / "short_line").write_text(f"{OLD}\nshort\n")
    env = {k: v.format(empty=tmp_path / "empty", short_line=tmp_path / "short_line") for k, v in env.items()}
    with pytest.raises(ConfigError, match=problem) as refused:
        TokenSource.from_env(env)
    assert "short\n" not in str(refused.value) and OLD not in str(refused.value)


def test_the_first_line_is_sent_and_every_line_accepted(tmp_path: Path) -> None:
    path = tmp_path / "token"
    replace_file(path, f"{OLD}\n")
    tokens = TokenSource.from_env({"KVRELAY_INTERNAL_TOKEN_FILE": str(path)})
    assert tokens.current() == OLD and tokens.accepts(OLD) and not tokens.accepts(NEW)
    replace_file(path, f"{OLD}\n{NEW}\n")  # step 1: everyone accepts both, still sends the old one
    assert tokens.current() == OLD and tokens.accepts(OLD) and tokens.accepts(NEW)
    replace_file(path, f"{NEW}\n{OLD}\n")  # step 2: everyone sends the new one
    assert tokens.current() == NEW and tokens.accepts(OLD)
    replace_file(path, f"{NEW}\n")  # step 3: the old one is gone
    assert tokens.current() == NEW and not tokens.accepts(OLD) and not tokens.accepts("")


@pytest.mark.parametrize("bad", ["", "\n", "short\n", f"{NEW}\nshort\n"])
def test_a_file_that_later_reads_empty_or_short_is_not_taken(tmp_path: Path, bad: str) -> None:
    path = tmp_path / "token"
    replace_file(path, f"{OLD}\n")
    tokens = TokenSource.from_env({"KVRELAY_INTERNAL_TOKEN_FILE": str(path)})
    replace_file(path, bad)
    assert tokens.current() == OLD and tokens.accepts(OLD) and not tokens.accepts("short")
    replace_file(path, f"{NEW}\n")
    assert tokens.current() == NEW
