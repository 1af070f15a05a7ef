"""The model manifest: sha256 of every file a model directory serves from, plus two fingerprints.

    tokenizer_fingerprint  identifies the tokenizer files (tokenizer.json, the chat template, ...).
                           The codec uses it; changing the template or the vocabulary changes it.
    model_fingerprint      identifies config.json, every *.safetensors and the tokenizer fingerprint.
                           Changing the weights changes only this one.

Both are the sha256 of canonical JSON (sorted keys, no spaces), so they are stable across machines.
Torch-free and stdlib-only: the codec imports this module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeGuard

from services.common.errors import CorruptModelError, ManifestMismatchError, ModelNotFoundError

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "kvrelay-manifest/v1"
TOKENIZER_KIND = "kvrelay-tokenizer/v1"
MODEL_KIND = "kvrelay-model/v1"
CONFIG_NAME = "config.json"
WEIGHTS_SUFFIX = ".safetensors"
GGUF_WEIGHTS_NAME = "model.gguf"  # the GGUF a directory was prepared from, kept when its blocks can be served
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
REQUIRED_TOKENIZER_FILE = "tokenizer.json"
CHUNK_SIZE = 1 << 20
_NOT_LISTED = "(unlisted)"
# model_fingerprint of a tokenizer-scope load of a directory without manifest.json: the weights were
# never read, so the model's identity is unknown.
UNKNOWN_FINGERPRINT = ""

Scope = Literal["model", "tokenizer"]


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_SIZE):
            digest.update(chunk)
    return digest.hexdigest()


def _canonical_sha256(obj: object) -> str:
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def is_tokenizer_file(name: str) -> bool:
    return name in TOKENIZER_FILES


def is_model_file(name: str) -> bool:
    """config.json and weights (the safetensors, and the GGUF kept beside them): the files the model
    fingerprint covers besides the tokenizer."""
    return name in (CONFIG_NAME, GGUF_WEIGHTS_NAME) or name.endswith(WEIGHTS_SUFFIX)


def tokenizer_fingerprint(files: Mapping[str, str]) -> str:
    """Fingerprint of the tokenizer files among `files` (name -> sha256); other names are ignored."""
    entries = {name: sha for name, sha in files.items() if is_tokenizer_file(name)}
    return _canonical_sha256({"kind": TOKENIZER_KIND, "files": entries})


def model_fingerprint(files: Mapping[str, str]) -> str:
    """Fingerprint of config.json, the weights and the tokenizer files among `files`."""
    entries = {name: sha for name, sha in files.items() if is_model_file(name)}
    return _canonical_sha256(
        {"kind": MODEL_KIND, "tokenizer_fingerprint": tokenizer_fingerprint(files), "files": entries}
    )


@dataclass(frozen=True)
class Manifest:
    """What a prepared model directory holds.

    `model_fingerprint` is UNKNOWN_FINGERPRINT ("") only for a tokenizer-scope load of a directory
    without manifest.json: that load never reads the weights, so the model's identity is unknown.
    """

    files: dict[str, str]
    tokenizer_fingerprint: str
    model_fingerprint: str
    source: dict[str, str] = field(default_factory=dict)

    @property
    def directory_fingerprint(self) -> str:
        """The prepared directory's model fingerprint: `model_fingerprint` itself, unless the weights served
        are another form of the directory's (GGUF blocks, loader.weights_fingerprint), whose manifest keeps
        the directory's under source["directory_fingerprint"]."""
        return self.source.get("directory_fingerprint", self.model_fingerprint)

    def to_json(self) -> str:
        body = {
            "format": MANIFEST_FORMAT,
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "model_fingerprint": self.model_fingerprint,
            "files": dict(sorted(self.files.items())),
            "source": dict(sorted(self.source.items())),
        }
        return json.dumps(body, indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, origin: str = MANIFEST_NAME) -> Manifest:
        """Parse a manifest; anything malformed raises CorruptModelError naming `origin`."""
        try:
            body = json.loads(text)
        except ValueError as exc:
            raise CorruptModelError(f"{origin} is not valid JSON: {exc}") from exc
        if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
            raise CorruptModelError(f"{origin} is not a {MANIFEST_FORMAT} manifest")
        files, source = body.get("files"), body.get("source", {})
        tok_fp, model_fp = body.get("tokenizer_fingerprint"), body.get("model_fingerprint")
        if not (_is_str_map(files) and _is_str_map(source)):
            raise CorruptModelError(f"{origin}: 'files' and 'source' must map strings to strings")
        if not (isinstance(tok_fp, str) and isinstance(model_fp, str)):
            raise CorruptModelError(f"{origin}: both fingerprints must be strings")
        return cls(files=dict(files), tokenizer_fingerprint=tok_fp, model_fingerprint=model_fp, source=source)


def _is_str_map(value: object) -> TypeGuard[dict[str, str]]:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _present_files(model_dir: Path, scope: Scope) -> list[str]:
    """Names of the files in `scope` that exist at the top level of `model_dir`, sorted."""
    names = [p.name for p in model_dir.iterdir() if p.is_file()]
    wanted = is_tokenizer_file if scope == "tokenizer" else _is_manifest_file
    return sorted(name for name in names if wanted(name))


def _is_manifest_file(name: str) -> bool:
    return is_tokenizer_file(name) or is_model_file(name)


def _manifest_from_files(files: dict[str, str], source: Mapping[str, str] | None) -> Manifest:
    return Manifest(
        files=files,
        tokenizer_fingerprint=tokenizer_fingerprint(files),
        model_fingerprint=model_fingerprint(files),
        source=dict(source or {}),
    )


def compute_manifest(model_dir: str | os.PathLike[str], source: Mapping[str, str] | None = None) -> Manifest:
    """Hash the tokenizer files, config.json and every *.safetensors in `model_dir`."""
    root = Path(model_dir)
    files = {name: sha256_file(root / name) for name in _present_files(root, "model")}
    return _manifest_from_files(files, source)


def write_manifest(model_dir: str | os.PathLike[str], manifest: Manifest) -> Path:
    """Write manifest.json atomically (temp file, then rename). Returns its path."""
    if manifest.model_fingerprint == UNKNOWN_FINGERPRINT:
        raise ValueError("refusing to write a manifest without a model fingerprint")
    path = Path(model_dir) / MANIFEST_NAME
    tmp = path.with_name(f".{MANIFEST_NAME}.tmp-{os.getpid()}")
    tmp.write_text(manifest.to_json(), encoding="utf-8")
    os.replace(tmp, path)
    return path


def _check_required(root: Path, scope: Scope) -> None:
    if not root.is_dir():
        raise ModelNotFoundError(f"model directory {str(root)!r} does not exist")
    if not (root / REQUIRED_TOKENIZER_FILE).is_file():
        raise ModelNotFoundError(f"{REQUIRED_TOKENIZER_FILE!r} is missing from model directory {str(root)!r}")
    if scope == "tokenizer":
        return
    if not (root / CONFIG_NAME).is_file():
        raise ModelNotFoundError(f"{CONFIG_NAME!r} is missing from model directory {str(root)!r}")
    if not any(p.name.endswith(WEIGHTS_SUFFIX) and p.is_file() for p in root.iterdir()):
        raise ModelNotFoundError(f"no '*{WEIGHTS_SUFFIX}' weights in model directory {str(root)!r}")


def _check_fingerprints(manifest: Manifest, origin: str) -> None:
    expected = _manifest_from_files(manifest.files, None)
    if manifest.tokenizer_fingerprint != expected.tokenizer_fingerprint:
        raise CorruptModelError(f"{origin}: tokenizer_fingerprint does not match its files list")
    if manifest.model_fingerprint != expected.model_fingerprint:
        raise CorruptModelError(f"{origin}: model_fingerprint does not match its files list")


def _check_files(root: Path, manifest: Manifest, scope: Scope) -> None:
    """Every listed file in scope exists and matches; no file in scope is present but unlisted."""
    in_scope = is_tokenizer_file if scope == "tokenizer" else _is_manifest_file
    for name, expected in sorted(manifest.files.items()):
        if not in_scope(name):
            continue
        path = root / name
        if not path.is_file():
            raise ModelNotFoundError(f"{name!r} is listed in the manifest but missing from {str(root)!r}")
        actual = sha256_file(path)
        if actual != expected:
            raise ManifestMismatchError(name, expected, actual)
    for name in _present_files(root, scope):
        if name not in manifest.files:
            raise ManifestMismatchError(name, _NOT_LISTED, sha256_file(root / name))


def load_verified_manifest(model_dir: str | os.PathLike[str], scope: Scope = "model") -> Manifest:
    """Check `model_dir` against its manifest.json, or compute a manifest when it has none.

    scope "model" hashes every listed file; scope "tokenizer" (the codec) hashes only tokenizer files.
    Raises ModelNotFoundError (directory or file missing), CorruptModelError (manifest unparsable or
    its fingerprints inconsistent) or ManifestMismatchError (a file's sha256 differs).
    """
    root = Path(model_dir)
    _check_required(root, scope)
    manifest_path = root / MANIFEST_NAME
    if manifest_path.is_file():
        origin = str(manifest_path)
        text = manifest_path.read_bytes().decode("utf-8", errors="replace")
        manifest = Manifest.from_json(text, origin=origin)
        _check_fingerprints(manifest, origin)
        _check_files(root, manifest, scope)
        return manifest
    files = {name: sha256_file(root / name) for name in _present_files(root, scope)}
    manifest = _manifest_from_files(files, None)
    if scope == "tokenizer":
        manifest = Manifest(files, manifest.tokenizer_fingerprint, UNKNOWN_FINGERPRINT)
    logger.info(
        "no %s in %s; computed tokenizer_fingerprint=%s model_fingerprint=%s from %d files",
        MANIFEST_NAME,
        root,
        manifest.tokenizer_fingerprint,
        manifest.model_fingerprint,
        len(files),
    )
    return manifest
