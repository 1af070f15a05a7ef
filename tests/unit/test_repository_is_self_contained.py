"""A fresh clone needs nothing beside it: no file of the repository (code, tests, Makefile, CI, docs) reads
or points at a `shared` folder next to the checkout, which only the team's machines have. What the tests
need from outside is vendored (tests/fixtures/openresponses, with its NOTICE)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.stack_helpers import REPO_ROOT

# `../shared`, `parent / "shared"`, `"..", "shared"`: the ways a path to the sibling folder is spelled.
SIBLING_SHARED = re.compile(r"""\.\./shared\b|/\s*["']shared["']|["']\.\.["']\s*,\s*["']shared["']""")


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO_ROOT, capture_output=True, check=True, timeout=60
    ).stdout.decode()
    return [REPO_ROOT / name for name in listed.split("\0") if name]


def test_no_file_reads_a_shared_folder_beside_the_checkout() -> None:
    this = Path(__file__).resolve()
    offenders = []
    for path in tracked_files():
        if path.resolve() == this or not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # binary: no paths to read
        offenders += [f"{path.relative_to(REPO_ROOT)}:{n}" for n, line in enumerate(text.splitlines(), 1)
                      if SIBLING_SHARED.search(line)]  # fmt: skip
    assert not offenders, f"files that reach outside the repository: {offenders}"


def test_the_pattern_sees_each_spelling() -> None:
    for line in ('REPO_ROOT.parent / "shared"', "cat ../shared/reference/x", 'os.path.join("..", "shared")'):
        assert SIBLING_SHARED.search(line), line
    assert not SIBLING_SHARED.search("shared_memory = True; services/common/shared_state.py")
