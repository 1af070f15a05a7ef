"""`prepare_from_gguf` keeps a GGUF the quantized weights path can serve (SmolLM2's: Q4_1, Q8_0, F32) as
model.gguf in the prepared directory, pinned by the manifest like the other weights. One prepare (~15 s)
for the module; the link-or-copy step is tested alone on small files."""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

import pytest

from services.common.errors import ManifestMismatchError
from services.common.manifest import GGUF_WEIGHTS_NAME, Manifest, load_verified_manifest, sha256_file
from services.engine.loading import prepare
from services.engine.loading.prepare import default_gguf_path, prepare_from_gguf


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Manifest, int]:
    """(a freshly prepared SmolLM2 directory, its manifest, the shipped GGUF's mode before preparing)."""
    mode_before = default_gguf_path().stat().st_mode
    out = tmp_path_factory.mktemp("prepare") / "smollm2"
    return out, prepare_from_gguf(default_gguf_path(), out), mode_before


def test_the_directory_keeps_the_gguf_as_stored(prepared: tuple[Path, Manifest, int]) -> None:
    out, manifest, _ = prepared
    kept = out / GGUF_WEIGHTS_NAME
    assert kept.is_file()
    assert sha256_file(kept) == manifest.source["gguf_sha256"]
    assert manifest.source["gguf"] == default_gguf_path().name  # the source still names the original
    assert not any(p.name.startswith(".") for p in out.iterdir())  # no partial copy left behind


def test_the_manifest_pins_the_kept_gguf(prepared: tuple[Path, Manifest, int]) -> None:
    out, manifest, _ = prepared
    assert manifest.files.get(GGUF_WEIGHTS_NAME) == manifest.source["gguf_sha256"]
    assert load_verified_manifest(out) == manifest


def test_a_replaced_gguf_fails_verification_naming_it(
    prepared: tuple[Path, Manifest, int], tmp_path: Path
) -> None:
    out, _, _ = prepared
    copy = tmp_path / "copy"
    copy.mkdir()
    for path in out.iterdir():
        if path.name != GGUF_WEIGHTS_NAME:
            os.symlink(path, copy / path.name)
    # A new file, never a write into the kept one: that may be a hard link to the shipped GGUF.
    with (out / GGUF_WEIGHTS_NAME).open("rb") as original:
        (copy / GGUF_WEIGHTS_NAME).write_bytes(original.read(1 << 20))
    with pytest.raises(ManifestMismatchError, match=r"model\.gguf"):
        load_verified_manifest(copy)


def test_preparing_leaves_the_shipped_gguf_as_it_was(prepared: tuple[Path, Manifest, int]) -> None:
    _, manifest, mode_before = prepared
    assert default_gguf_path().stat().st_mode == mode_before  # a hard link must not be chmod-ed
    assert sha256_file(default_gguf_path()) == manifest.source["gguf_sha256"]


def test_the_gguf_is_hard_linked_on_one_filesystem(tmp_path: Path) -> None:
    source = tmp_path / "src.gguf"
    source.write_bytes(b"GGUF" + bytes(60))
    staging = tmp_path / "staging"
    staging.mkdir()
    try:
        os.link(source, tmp_path / "probe")
    except OSError:
        pytest.skip("this filesystem has no hard links")
    source.chmod(0o600)
    prepare._keep_gguf(source, staging)
    assert (staging / GGUF_WEIGHTS_NAME).stat().st_ino == source.stat().st_ino
    prepare._publish(staging, tmp_path / "out")
    assert stat.S_IMODE(source.stat().st_mode) == 0o600  # publishing chmods the directory's own files only


def test_the_gguf_is_copied_when_it_cannot_be_linked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def cross_device(src: object, dst: object) -> None:
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    source = tmp_path / "src.gguf"
    source.write_bytes(b"GGUF" + bytes(range(60)))
    source.chmod(0o444)
    staging = tmp_path / "staging"
    staging.mkdir()
    monkeypatch.setattr(prepare.os, "link", cross_device)
    prepare._keep_gguf(source, staging)
    kept = staging / GGUF_WEIGHTS_NAME
    assert kept.read_bytes() == source.read_bytes()
    assert kept.stat().st_ino != source.stat().st_ino
    assert sorted(p.name for p in staging.iterdir()) == [GGUF_WEIGHTS_NAME]
    out = tmp_path / "out"
    prepare._publish(staging, out)
    assert (
        stat.S_IMODE((out / GGUF_WEIGHTS_NAME).stat().st_mode) == 0o644
    )  # a copy is published like the rest
    assert stat.S_IMODE(source.stat().st_mode) == 0o444
    shutil.rmtree(out)
