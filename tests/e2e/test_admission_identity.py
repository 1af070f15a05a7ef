"""Who a request is for, on a real stack (worker, router, codec) with an API keys file written by
`kvrelay keys`: 401s in each protocol's shape, Bearer and x-api-key, keys added and revoked while the
codec runs, prefix caches that tenants do not share, and logs that hold no prompt or completion text."""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from services.codec.admission.auth import read_keys_file
from tests.e2e.conftest import RunningStack, start_stack
from tests.reference_prompts import long_text
from tests.stack_helpers import KVRELAY, REPO_ROOT, wait_until

pytestmark = pytest.mark.model

WRONG_KEY = "kvr-000000000000-wrong-secret"
ROTATION_DEADLINE_S = 30.0  # the codec looks at the keys file once a second; generous for a loaded host


@dataclass
class KeyedStack:
    stack: RunningStack
    keys_file: Path
    logs: Path
    keys: dict[str, str]  # tenant → key

    @property
    def url(self) -> str:
        return self.stack.base_url

    def model(self) -> str:
        return str(self.get("/v1/models", self.keys["alpha"]).json()["data"][0]["id"])

    def get(self, path: str, key: str | None = None, **kwargs: Any) -> httpx.Response:
        return httpx.get(f"{self.url}{path}", headers=bearer(key), timeout=60, **kwargs)

    def post(self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, headers=headers or {}, timeout=120)


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"authorization": f"Bearer {key}"}


def keys_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*KVRELAY, "keys", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=60
    )


def add_key(keys_file: Path, tenant: str) -> str:
    return keys_cli("add", "--file", str(keys_file), "--tenant", tenant).stdout.strip()


@pytest.fixture(scope="module")
def keyed(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedStack]:
    root = tmp_path_factory.mktemp("admission-identity")
    keys_file = root / "keys.yaml"
    keys = {tenant: add_key(keys_file, tenant) for tenant in ("alpha", "bravo")}
    logs = root / "logs"
    logs.mkdir()
    stack = start_stack(model_dir, logs, KVRELAY_AUTH__KEYS_FILE=str(keys_file))
    try:
        yield KeyedStack(stack, keys_file, logs, keys)
    finally:
        for proc in reversed(stack.procs):
            proc.stop()


def test_the_keys_file_holds_no_key(keyed: KeyedStack) -> None:
    text = keyed.keys_file.read_text()
    assert all(key not in text for key in keyed.keys.values())
    assert {r.tenant for r in read_keys_file(keyed.keys_file)} == {"alpha", "bravo"}


def generation_routes(model: str) -> list[tuple[str, dict[str, Any]]]:
    return [
        (
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
        ),
        ("/v1/completions", {"model": model, "prompt": "Hi", "max_tokens": 2}),
        ("/v1/responses", {"model": model, "input": "Hi", "max_output_tokens": 2}),
        ("/tokenize", {"model": model, "prompt": "Hi"}),
    ]


@pytest.mark.parametrize("key", [None, WRONG_KEY], ids=["no-key", "wrong-key"])
def test_a_missing_or_wrong_key_is_401_in_each_protocols_shape(keyed: KeyedStack, key: str | None) -> None:
    model = keyed.model()
    for path, body in generation_routes(model):
        response = keyed.post(path, body, bearer(key))
        assert response.status_code == 401, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error", path
        assert error["code"] == (None if key is None else "invalid_api_key"), path
    models = keyed.get("/v1/models", key)
    assert models.status_code == 401 and models.json()["error"]["type"] == "invalid_request_error"
    headers = {} if key is None else {"x-api-key": key, "anthropic-version": "2023-06-01"}
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    messages = keyed.post("/v1/messages", body, headers)
    assert messages.status_code == 401
    assert messages.json()["type"] == "error"
    assert messages.json()["error"]["type"] == "authentication_error"
    assert messages.json()["request_id"] == messages.headers["request-id"]


def test_probes_and_metrics_need_no_key(keyed: KeyedStack) -> None:
    for path in ("/health", "/ready", "/metrics"):
        assert keyed.get(path).status_code == 200, path


def test_bearer_and_x_api_key_both_work_with_the_sdks(keyed: KeyedStack) -> None:
    model = keyed.model()
    with openai.OpenAI(
        base_url=f"{keyed.url}/v1",
        api_key=keyed.keys["alpha"],
        max_retries=0,
        _strict_response_validation=True,
    ) as client:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        assert reply.usage is not None and reply.usage.completion_tokens > 0
    with anthropic.Anthropic(
        base_url=keyed.url, api_key=keyed.keys["bravo"], max_retries=0, _strict_response_validation=True
    ) as claude:
        message = claude.messages.create(
            model=model, max_tokens=3, messages=[{"role": "user", "content": "Hi"}]
        )
        assert message.usage.output_tokens > 0
    with (
        openai.OpenAI(
            base_url=f"{keyed.url}/v1", api_key=WRONG_KEY, max_retries=0, _strict_response_validation=True
        ) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()
    with (
        anthropic.Anthropic(
            base_url=keyed.url, api_key=WRONG_KEY, max_retries=0, _strict_response_validation=True
        ) as claude,
        pytest.raises(anthropic.AuthenticationError),
    ):
        claude.messages.create(model=model, max_tokens=3, messages=[{"role": "user", "content": "Hi"}])


def test_keys_are_added_and_revoked_without_a_restart(keyed: KeyedStack) -> None:
    codec = keyed.stack.procs[-1].popen
    key = add_key(keyed.keys_file, "charlie")
    wait_until(
        lambda: keyed.get("/v1/models", key).status_code == 200,
        ROTATION_DEADLINE_S,
        "the codec accepting a key added to its keys file",
    )
    key_id = next(r.key_id for r in read_keys_file(keyed.keys_file) if r.tenant == "charlie")
    keys_cli("revoke", "--file", str(keyed.keys_file), "--key-id", key_id)
    wait_until(
        lambda: keyed.get("/v1/models", key).status_code == 401,
        ROTATION_DEADLINE_S,
        "the codec refusing a key revoked in its keys file",
    )
    assert keyed.get("/v1/models", keyed.keys["alpha"]).status_code == 200  # the others are untouched
    assert codec.poll() is None  # the same process throughout


def cached_tokens(keyed: KeyedStack, tenant: str, prompt: str) -> int:
    body = {"model": keyed.model(), "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = keyed.post("/v1/completions", body, bearer(keyed.keys[tenant]))
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["prompt_tokens"] > 64
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def metric(text: str, name: str, tenant: str) -> float:
    prefix = f'{name}{{tenant="{tenant}"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def test_one_tenants_cached_prefix_gives_no_hit_to_another(keyed: KeyedStack) -> None:
    prompt = f"Request {secrets.token_hex(8)}.\n" + long_text(8, 5)  # never sent before, by anyone
    assert cached_tokens(keyed, "alpha", prompt) == 0
    assert cached_tokens(keyed, "alpha", prompt) > 0  # the same tenant's repeat hits
    assert cached_tokens(keyed, "bravo", prompt) == 0  # another tenant's identical prompt does not
    assert cached_tokens(keyed, "bravo", prompt) > 0  # ... until it cached the prefix itself
    text = keyed.get("/metrics").text
    assert metric(text, "kvrelay_prefix_cache_hit_tokens_total", "alpha") > 0
    assert metric(text, "kvrelay_prefix_cache_query_tokens_total", "bravo") > 0


def test_no_log_line_holds_prompt_or_completion_text(keyed: KeyedStack) -> None:
    canary = f"canary-{secrets.token_hex(6)}"
    model = keyed.model()
    ask = f"Repeat this word exactly: {canary}"
    alpha, bravo = bearer(keyed.keys["alpha"]), {"x-api-key": keyed.keys["bravo"]}
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": ask}],
        "max_tokens": 16,
        "temperature": 0,
    }
    completions: list[str] = []
    replies = [
        keyed.post("/v1/chat/completions", chat, alpha),
        keyed.post("/v1/chat/completions", {**chat, "stream": True}, alpha),
        keyed.post(
            "/v1/completions", {"model": model, "prompt": ask, "max_tokens": 16, "temperature": 0}, alpha
        ),
        keyed.post("/v1/responses", {"model": model, "input": ask, "max_output_tokens": 16}, bravo),
        keyed.post("/v1/messages", {"model": model, "max_tokens": 16, "messages": chat["messages"]}, bravo),
        keyed.post("/tokenize", {"model": model, "prompt": ask}, alpha),
        keyed.post("/v1/chat/completions", {**chat, "max_tokens": -1}, alpha),  # a 400
        keyed.post("/v1/chat/completions", chat, {"x-api-key": f"{canary}-as-a-key"}),  # a 401
    ]
    assert [r.status_code for r in replies] == [200, 200, 200, 200, 200, 200, 400, 401]
    completions.append(replies[0].json()["choices"][0]["message"]["content"])
    completions.append(replies[2].json()["choices"][0]["text"])
    request_ids = [r.headers["x-request-id"] for r in replies]
    codec_log = keyed.logs / "codec.log"

    def logged() -> bool:
        return all(rid in codec_log.read_text() for rid in request_ids)

    wait_until(logged, 30.0, "every request's line in the codec log")

    audit = [json.loads(line) for line in codec_log.read_text().splitlines() if '"kvrelay.access"' in line]
    by_id = {line["request_id"]: line for line in audit}
    first = by_id[request_ids[0]]
    assert first["tenant"] == "alpha" and first["key_id"] and first["route"] == "/v1/chat/completions"
    assert first["status"] == 200 and first["prompt_tokens"] > 0 and first["e2e_ms"] > 0
    assert by_id[request_ids[3]]["tenant"] == "bravo"
    assert by_id[request_ids[-1]]["status"] == 401 and by_id[request_ids[-1]]["tenant"] is None

    secrets_and_text = [canary, *keyed.keys.values(), *(c for c in completions if len(c.strip()) >= 24)]
    for log in sorted(keyed.logs.glob("*.log")):
        text = log.read_text(errors="replace")
        assert text, log  # every service did log something
        for needle in secrets_and_text:
            assert needle not in text, f"{log.name} holds {needle[:12]!r}…"
    assert {p.name for p in keyed.logs.glob("*.log")} >= {"codec.log", "router.log", "worker.log"}
