"""`kvrelay codec` flags, the verified tokenizer identity, and the gRPC backend's construction."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.cli import codec as codec_cli
from services.codec.server import DEFAULT_GRACE_S, connect_backend, load_tokenizer
from services.common.config import KvrelayConfig, ModelConfig
from services.common.manifest import load_verified_manifest


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvrelay")
    codec_cli.register(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_codec_flags_and_defaults() -> None:
    args = parse(["codec", "--router", "127.0.0.1:7000", "--model", "m", "--config", "c.yaml"])
    assert (args.router, args.model, args.config) == ("127.0.0.1:7000", "m", "c.yaml")
    assert (args.host, args.port, args.grace_seconds) == (None, None, DEFAULT_GRACE_S)
    assert args.handler is codec_cli.run
    args = parse(["codec", "--router", "r:1", "--host", "0.0.0.0", "--port", "9000"])
    assert (args.host, args.port) == ("0.0.0.0", 9000)


def test_router_is_required() -> None:
    with pytest.raises(SystemExit):
        parse(["codec"])


@pytest.mark.model
def test_identity_comes_from_the_verified_manifest(model_dir: Path) -> None:
    manifest = load_verified_manifest(model_dir, scope="tokenizer")
    tokenizer, identity = load_tokenizer(model_dir, KvrelayConfig())
    assert identity.model_name == model_dir.resolve().name
    assert identity.tokenizer_fingerprint == manifest.tokenizer_fingerprint
    assert identity.model_fingerprint == manifest.model_fingerprint
    assert tokenizer.vocab_size > 0
    named = KvrelayConfig(model=ModelConfig(served_name="tiny"))
    assert load_tokenizer(model_dir, named)[1].model_name == "tiny"


async def test_grpc_backend_is_built_lazily_for_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_INTERNAL_TOKEN", "t0ken-0123456789abcdef")
    backend = connect_backend("127.0.0.1:1")
    try:
        assert backend.router_address == "127.0.0.1:1"  # type: ignore[attr-defined]
    finally:
        await backend.close()
