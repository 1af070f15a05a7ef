"""Secure defaults on the codec (issue 22): open mode only on loopback unless auth.allow_open, /status only
for an admin key once keys exist, /metrics off the API port when it has its own, a log level per service."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.codec.admission.auth import Authenticator, KeyRecord, key_digest, new_key, read_keys_file
from services.codec.admission.auth import write_keys_file as write_keys
from services.codec.server import check_open_mode
from services.codec.state import CodecIdentity
from services.codec.text.tokenizer import Tokenizer
from services.common.config import AuthConfig, KvrelayConfig, LoggingConfig, ServerConfig, load_config
from services.common.errors import ConfigError
from tests.codec_fakes import FakeBackend, identity_for, make_app
from tests.conftest import REPO_ROOT


def _key(path: Path, tenant: str, *, admin: bool = False) -> str:
    records = read_keys_file(path) if path.exists() else []
    key_id, key = new_key()
    write_keys(path, [*records, KeyRecord(key_id=key_id, tenant=tenant, sha256=key_digest(key), admin=admin)])
    return key


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.5"])
def test_open_mode_is_allowed_on_loopback(host: str) -> None:
    check_open_mode(Authenticator(None), host, allow_open=False)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "codec.example.com"])
def test_open_mode_is_refused_off_loopback_naming_both_ways_out(host: str) -> None:
    with pytest.raises(ConfigError) as refused:
        check_open_mode(Authenticator(None), host, allow_open=False)
    assert "auth.keys_file" in str(refused.value) and "auth.allow_open" in str(refused.value)
    check_open_mode(Authenticator(None), host, allow_open=True)


def test_keys_allow_any_address(tmp_path: Path) -> None:
    _key(tmp_path / "keys.yaml", "acme")
    check_open_mode(
        Authenticator.from_config(AuthConfig(keys_file=str(tmp_path / "keys.yaml"))),
        "0.0.0.0",
        allow_open=False,
    )


def test_the_codec_process_refuses_open_mode_on_all_interfaces(model_dir: Path) -> None:
    args = ["codec", "--model", str(model_dir), "--router", "127.0.0.1:9", "--host", "0.0.0.0", "--port", "9"]
    done = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert done.returncode != 0
    assert "refusing to serve without API keys on 0.0.0.0" in done.stderr, done.stderr[-2000:]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture
def identity(model_dir: Path) -> CodecIdentity:
    return identity_for(model_dir)


@pytest.fixture
async def keyed(
    tokenizer: Tokenizer, identity: CodecIdentity, tmp_path: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, str]]]:
    path = tmp_path / "keys.yaml"
    keys = {"user": _key(path, "acme"), "admin": _key(path, "ops", admin=True)}
    config = KvrelayConfig(auth=AuthConfig(keys_file=str(path)))
    app = make_app(tokenizer, FakeBackend(identity.tokenizer_fingerprint), identity, config)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        yield client, keys


async def test_status_needs_an_admin_key_once_keys_exist(
    keyed: tuple[httpx.AsyncClient, dict[str, str]],
) -> None:
    client, keys = keyed
    refused = await client.get("/status", headers={"authorization": f"Bearer {keys['user']}"})
    assert refused.status_code == 403, refused.text
    assert "admin key" in refused.json()["error"]["message"]
    allowed = await client.get("/status", headers={"authorization": f"Bearer {keys['admin']}"})
    assert allowed.status_code == 200, allowed.text
    assert allowed.json()["services"][0]["name"] == "codec"


async def test_status_stays_open_in_open_mode(tokenizer: Tokenizer, identity: CodecIdentity) -> None:
    app = make_app(tokenizer, FakeBackend(identity.tokenizer_fingerprint), identity, KvrelayConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        assert (await client.get("/status")).status_code == 200


async def test_metrics_leave_the_api_port_when_they_have_their_own(
    tokenizer: Tokenizer, identity: CodecIdentity
) -> None:
    for metrics_port, expected in ((None, 200), (9090, 404)):
        config = KvrelayConfig(server=ServerConfig(metrics_port=metrics_port))
        app = make_app(tokenizer, FakeBackend(identity.tokenizer_fingerprint), identity, config)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://codec") as client:
            response = await client.get("/metrics")
        assert response.status_code == expected, (metrics_port, response.text[:200])
        if expected == 200:
            assert "kvrelay_codec" in response.text


def test_keys_add_admin_marks_the_record(tmp_path: Path) -> None:
    path = tmp_path / "keys.yaml"
    for extra in ([], ["--admin"]):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli.main",
                "keys",
                "add",
                "--file",
                str(path),
                "--tenant",
                "ops",
                *extra,
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
    assert [record.admin for record in read_keys_file(path)] == [False, True]


def test_log_level_per_service_with_a_default() -> None:
    config = load_config(None, env={"KVRELAY_LOGGING__LEVEL": "warning", "KVRELAY_LOGGING__ROUTER": "debug"})
    assert config.logging.for_service("router") == "debug"
    assert config.logging.for_service("codec") == config.logging.for_service("worker") == "warning"
    assert LoggingConfig().for_service("codec") == "info"
    with pytest.raises(ConfigError, match=r"logging\.worker"):
        load_config(None, env={"KVRELAY_LOGGING__WORKER": "chatty"})
