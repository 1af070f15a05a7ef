"""GGUFs shipped on PyPI: split ones are assembled from their part packages and checked against the
sha256 their assembler package lists. Fake packages on sys.path stand in for the real ones."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from services.cli.models import PACKAGED_MODELS
from services.common.errors import ConfigError, CorruptModelError, ModelNotFoundError
from services.engine.loading.prepare import (
    DEFAULT_PACKAGE,
    PACKAGED_GGUFS,
    PackagedGGUF,
    assemble_gguf,
    gguf_part_paths,
    prepare_from_package,
)

FILE = "tiny.gguf"
CHUNKS = [b"GGUF" + bytes(range(60)), bytes(range(100, 200)), b"tail"]


def fake_packages(root: Path, chunks: list[bytes], listed: bytes | None = None) -> PackagedGGUF:
    """An assembler package `fake_gguf` (data/SHA256SUMS) and one part package per chunk."""
    data = root / "fake_gguf" / "data"
    data.mkdir(parents=True)
    (root / "fake_gguf" / "__init__.py").write_text("raise ImportError('never imported')\n")
    digest = hashlib.sha256(listed if listed is not None else b"".join(chunks)).hexdigest()
    (data / "SHA256SUMS").write_text(f"{digest}  {FILE}\n")
    parts = []
    for i, chunk in enumerate(chunks):
        part = root / f"fake_gguf_part{i + 1}"
        (part / "data").mkdir(parents=True)
        (part / "__init__.py").write_text("raise ImportError('never imported')\n")
        (part / "data" / f"{FILE}.part{i:02d}").write_bytes(chunk)
        parts.append(part.name)
    return PackagedGGUF(FILE, "fake_gguf", "fake-gguf", tuple(parts))


def test_parts_are_concatenated_in_order_and_checked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    packaged = fake_packages(tmp_path / "site", CHUNKS)
    assert [p.name for p in gguf_part_paths(packaged)] == [f"{FILE}.part0{i}" for i in range(3)]
    out = tmp_path / "out"
    out.mkdir()
    assert assemble_gguf(packaged, out).read_bytes() == b"".join(CHUNKS)


def test_a_wrong_chunk_is_corrupt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    packaged = fake_packages(tmp_path / "site", CHUNKS, listed=b"something else")
    with pytest.raises(CorruptModelError, match=r"tiny\.gguf has sha256"):
        assemble_gguf(packaged, tmp_path)


def test_a_missing_part_package_is_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    packaged = fake_packages(tmp_path / "site", CHUNKS)
    missing = PackagedGGUF(
        FILE, packaged.package, packaged.distribution, (*packaged.parts, "fake_gguf_part9")
    )
    with pytest.raises(ModelNotFoundError, match=r"fake_gguf_part9.*pip install fake-gguf"):
        assemble_gguf(missing, tmp_path)


def test_unknown_package_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="gemma3-270m"):
        prepare_from_package("no-such-model", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_choices_are_the_packaged_models() -> None:
    assert set(PACKAGED_MODELS) == set(PACKAGED_GGUFS) and PACKAGED_MODELS[0] == DEFAULT_PACKAGE
    gemma = PACKAGED_GGUFS["gemma3-270m"]
    assert gemma.file_name == "gemma-3-270m-q4_k_m.gguf" and len(gemma.parts) == 4
