"""The codec's rooms (docs/architecture.md): at most 12 modules at its top (what each room may import is an
import-linter contract, test_import_contract.py), errors reaching the wire through the registered handlers
alone, and the modules a streamed chat request runs through, traced, equal to the list the architecture doc
gives."""

from __future__ import annotations

import ast
import os
import re
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest

from services.codec.state import CodecIdentity
from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

ROOT = Path(__file__).resolve().parents[2]
CODEC = ROOT / "services" / "codec"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MAX_TOP_MODULES = 12
# The rooms; what each may import is an import-linter contract (pyproject.toml, test_import_contract.py).
ROOMS = {"text", "protocols", "admission", "backend", "grpc_public", "lane"}


def test_at_most_twelve_modules_sit_directly_in_the_codec() -> None:
    top = sorted(p.name for p in CODEC.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    assert {p.name for p in CODEC.iterdir() if p.is_dir() and (p / "__init__.py").exists()} >= ROOMS


def handled_errors(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ExceptHandler) and node.type is not None:
            types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
            names |= {t.id if isinstance(t, ast.Name) else ast.unparse(t) for t in types}
    return names


def test_no_route_answers_an_admission_refusal_by_hand() -> None:
    """Refusals reach the wire through the registered handler (errors.py), in each protocol's shape."""
    routes = [*(CODEC / "protocols").glob("*.py"), CODEC / "routes_misc.py", CODEC / "routes_health.py"]
    refusals = {"AdmissionRefusedError", "RateLimitedError", "OverloadedError", "QuotaUnavailableError"}
    offenders = {
        f"{p.name}: {sorted(handled_errors(p) & refusals)}" for p in routes if handled_errors(p) & refusals
    }
    assert not offenders
    assert "refusal_response" not in "".join(p.read_text() for p in CODEC.rglob("*.py"))


def documented_modules() -> list[str]:
    text = " ".join(ARCHITECTURE.read_text().split())
    match = re.search(r"these \*\*(\d+) codec modules\*\*: ([^.]+)\.", text)
    assert match, (
        "docs/architecture.md no longer says which codec modules a streamed chat request runs through"
    )
    modules = [m.strip() for m in match.group(2).split(",")]
    assert len(modules) == int(match.group(1))
    return modules


@pytest.mark.model
async def test_a_streamed_chat_request_runs_through_the_modules_the_architecture_doc_lists(
    model_dir: Path,
) -> None:
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    fake.script = scripted([tokenizer.encode("Hello world!")])
    identity = CodecIdentity(MODEL_NAME, identity_for(model_dir).tokenizer_fingerprint)
    app = make_app(tokenizer, fake, identity)
    seen: set[str] = set()
    prefix = str(CODEC) + os.sep

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(prefix):
            seen.add(frame.f_code.co_filename[len(prefix) :].removesuffix(".py"))

    body = {"model": MODEL_NAME, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200  # warm: lazy caches
        sys.setprofile(profile)
        threading.setprofile(profile)
        # the template and tokenizer run in the prompt pool's thread, started by the warm-up request:
        # that idle thread is the one anyio hands the next piece of work
        await anyio.to_thread.run_sync(sys.setprofile, profile)
        try:
            response = await client.post("/v1/chat/completions", json=body)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            await anyio.to_thread.run_sync(sys.setprofile, None)
    assert response.status_code == 200 and "Hello world!" in "".join(
        re.findall(r'"content":"([^"]*)"', response.text)
    )
    assert sorted(seen) == sorted(documented_modules())
