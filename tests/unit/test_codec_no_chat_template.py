"""A model without a chat template (a base model such as Gemma 3 270M): completions and the raw-prompt
routes work, chat routes answer a clear 400, and `model.chat_template` in the config supplies one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, ModelConfig
from services.common.errors import ConfigError
from services.common.manifest import compute_manifest, write_manifest
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted
from tests.tiny_model import write_word_tokenizer

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 4}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Tokenizer files only, and no chat template anywhere."""
    write_word_tokenizer(tmp_path, 64)
    write_manifest(tmp_path, compute_manifest(tmp_path))
    assert Tokenizer.from_dir(tmp_path).chat_template is None
    return tmp_path


async def client_for(
    model_dir: Path, config: KvrelayConfig
) -> AsyncIterator[tuple[httpx.AsyncClient, FakeBackend]]:
    identity = identity_for(model_dir)
    fake = FakeBackend(identity.tokenizer_fingerprint, vocab_size=64)
    fake.script = scripted([[7, 8]], eos_token_id=1)
    app = make_app(Tokenizer.from_dir(model_dir), fake, identity, config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client, fake


@pytest.fixture
async def plain(model_dir: Path) -> AsyncIterator[tuple[httpx.AsyncClient, FakeBackend]]:
    async for pair in client_for(model_dir, KvrelayConfig()):
        yield pair


async def test_completions_are_served(plain: tuple[httpx.AsyncClient, FakeBackend]) -> None:
    client, fake = plain
    body = {"model": MODEL_NAME, "prompt": "t5 t6", "max_tokens": 4}
    reply = await client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"].split() == ["t7", "t8"]
    assert fake.seen[-1].prompt_token_ids == [5, 6]


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/messages", CHAT),
        ("/v1/responses", {"model": MODEL_NAME, "input": "t5 t6", "max_output_tokens": 4}),
    ],
)
async def test_chat_routes_answer_400_naming_the_missing_template(
    plain: tuple[httpx.AsyncClient, FakeBackend], route: str, body: dict[str, object]
) -> None:
    client, fake = plain
    reply = await client.post(route, json=body)
    assert reply.status_code == 400, reply.text
    assert "no chat template" in reply.text
    assert not fake.seen


async def test_a_template_from_the_config_serves_chat(model_dir: Path, tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}t9")
    config = KvrelayConfig(model=ModelConfig(chat_template=str(template)))
    async for client, fake in client_for(model_dir, config):
        reply = await client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200, reply.text
        assert fake.seen[-1].prompt_token_ids == [5, 6, 9]


async def test_an_unreadable_template_file_is_a_config_error(model_dir: Path, tmp_path: Path) -> None:
    config = KvrelayConfig(model=ModelConfig(chat_template=str(tmp_path / "absent.jinja")))
    with pytest.raises(ConfigError, match=r"absent\.jinja"):
        async for _ in client_for(model_dir, config):
            pass
