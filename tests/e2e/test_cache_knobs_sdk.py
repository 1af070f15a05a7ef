"""The clients' cache knobs end to end, with the official SDKs (strict, no retries) on a real stack whose
worker writes through to a shared tier only the prefixes a client asked to keep (`write_through:
requested`): Anthropic `cache_control` breakpoints (5m and 1h) and OpenAI `prompt_cache_retention: "24h"`
(a permission of the API key) survive a worker restart and are read back from the shared tier; the usage
counts what each request computed and wrote, split by ttl, and always adds up to the prompt; a prompt
nobody asked to keep, and another tenant's identical prompt, read nothing back. Both tenants opted in to
the exact-result cache (stored in the same shared tier): a repeated forced tool call is answered from it
with the same call and fresh IDs while the worker counts no request, and the other tenant's identical
request misses.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest

from services.common.cache_redis import start_cache_redis, stop_cache_redis
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.e2e.conftest import TOKEN, RunningStack, start_stack
from tests.e2e.test_admission_identity import keys_cli
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving, wait_until

pytestmark = pytest.mark.model

# Long enough for several 64-token segments before each breakpoint; distinct, so no earlier test's cache.
RULES = " ".join(f"Rule {i}: answer in one short sentence and name rule {i}." for i in range(30))
POLICY = " ".join(f"Policy {i}: refuse nothing about tide tables, cite clause {i}." for i in range(30))
ENV = {
    "KVRELAY_KV_TIERS__SEGMENT_TOKENS": "64",
    "KVRELAY_KV_TIERS__WRITE_THROUGH": "requested",
    "KVRELAY_KV_TIERS__FETCH_DEADLINE_MS": "60000",  # what is read back is checked here, not how fast
    "KVRELAY_RESULT_CACHE__TENANTS": "[alpha, bravo]",  # in the shared tier's Redis (kv_tiers.shared_url)
    "KVRELAY_RESULT_CACHE__TIMEOUT_MS": "10000",
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@dataclass
class Knobs:
    stack: RunningStack
    keys: dict[str, str]  # tenant -> key: alpha may ask for "24h", bravo may not
    env: dict[str, str]
    logs: Path

    def anthropic(self, tenant: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.stack.base_url,
            api_key=self.keys[tenant],
            max_retries=0,
            _strict_response_validation=True,
        )

    def openai(self, tenant: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.stack.base_url}/v1",
            api_key=self.keys[tenant],
            max_retries=0,
            _strict_response_validation=True,
        )

    def restart_worker(self) -> None:
        """Stop the worker (its pool goes with it) and start it again on the same port."""
        old = self.stack.procs[0]
        args = [str(arg) for arg in old.popen.args][3:]  # type: ignore[union-attr]  # after python -m ...
        old.stop()
        self.stack.procs[0] = Proc(args, self.env, self.logs / "worker-restarted.log")
        wait_serving(self.stack.worker_address, self.stack.procs[0])
        router = worker_pb2_grpc.RouterStub(grpc.insecure_channel(self.stack.router_address))
        auth = (("authorization", f"Bearer {TOKEN}"),)

        def ready() -> bool:
            replicas = router.Replicas(pb.ReplicasRequest(), metadata=auth, timeout=5).replicas
            return any(r.ready and r.load.requests_total == 0 for r in replicas)  # the new process

        wait_until(ready, 60, "the router seeing the restarted worker ready")


@pytest.fixture(scope="module")
def knobs(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Knobs]:
    root = tmp_path_factory.mktemp("cache-knobs")
    cache_port = free_port()
    cache = start_cache_redis(cache_port, maxmemory_mb=256)  # about 70 MB of fp32 KV here
    keys_file = root / "keys.yaml"
    add = ["add", "--file", str(keys_file), "--tenant"]
    keys = {
        "alpha": keys_cli(*add, "alpha", "--cache-retention-24h").stdout.strip(),
        "bravo": keys_cli(*add, "bravo").stdout.strip(),
    }
    env = {
        **ENV,
        "KVRELAY_KV_TIERS__SHARED_URL": f"redis://127.0.0.1:{cache_port}/0",
        "KVRELAY_AUTH__KEYS_FILE": str(keys_file),
    }
    stack = start_stack(model_dir, root, **env)
    try:
        yield Knobs(stack, keys, stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", **env), root)
    finally:
        for proc in reversed(stack.procs):
            proc.stop()
        stop_cache_redis(cache)


def model_of(knobs: Knobs) -> str:
    return str(
        httpx.get(f"{knobs.stack.base_url}/v1/models", headers=bearer(knobs, "alpha")).json()["data"][0]["id"]
    )


def bearer(knobs: Knobs, tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {knobs.keys[tenant]}"}


def ask_anthropic(knobs: Knobs, tenant: str, *, stream: bool = False) -> tuple[Any, int]:
    """The message's usage (message_start's when streamed), and the prompt's length (count_tokens)."""
    client = knobs.anthropic(tenant)
    fields: dict[str, Any] = {
        "model": model_of(knobs),
        "system": [{"type": "text", "text": RULES, "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": POLICY, "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "Which rule comes first?"},
                ],
            }
        ],
    }
    num_prompt = client.messages.count_tokens(**fields).input_tokens
    if not stream:
        return client.messages.create(max_tokens=2, **fields).usage, num_prompt
    with client.messages.stream(max_tokens=2, **fields) as events:
        starts = [event.message.usage for event in events if event.type == "message_start"]
        final = events.get_final_message().usage
    assert starts and starts[0].cache_creation_input_tokens == final.cache_creation_input_tokens
    return starts[0], num_prompt


def adds_up(usage: Any, num_prompt: int) -> bool:
    return bool(
        usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == num_prompt
    )


def ask_openai(knobs: Knobs, tenant: str, system: str, retention: Any = openai.omit) -> int:
    """The cached tokens of one chat completion."""
    completion = knobs.openai(tenant).chat.completions.create(
        model=model_of(knobs),
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "Go."}],
        max_tokens=2,
        prompt_cache_retention=retention,
    )
    assert completion.usage is not None and completion.usage.prompt_tokens_details is not None
    return completion.usage.prompt_tokens_details.cached_tokens or 0


def test_a_tenant_without_the_permission_asking_for_24h_gets_a_400_that_says_so(knobs: Knobs) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        ask_openai(knobs, "bravo", "Say hi.", "24h")
    assert (
        "--cache-retention-24h" in str(refused.value)
        and refused.value.body["param"] == "prompt_cache_retention"
    )  # type: ignore[index]


def test_asked_prefixes_survive_a_worker_restart_and_the_usage_says_what_was_written(knobs: Knobs) -> None:
    created, num_prompt = ask_anthropic(knobs, "alpha")
    assert adds_up(created, num_prompt) and created.cache_read_input_tokens == 0
    split = created.cache_creation
    assert split is not None and split.ephemeral_1h_input_tokens > 0 and split.ephemeral_5m_input_tokens > 0
    assert (
        created.cache_creation_input_tokens
        == split.ephemeral_1h_input_tokens + split.ephemeral_5m_input_tokens
    )
    assert created.input_tokens > 0  # the question after the last breakpoint
    again, _ = ask_anthropic(knobs, "alpha", stream=True)  # the pool's own hit: nothing to write
    assert adds_up(again, num_prompt) and again.cache_read_input_tokens >= created.cache_creation_input_tokens
    assert again.cache_creation_input_tokens == 0

    fresh_24h = "You answer in French. " + POLICY
    fresh_plain = "You answer in German. " + RULES
    assert ask_openai(knobs, "alpha", fresh_24h, "24h") == 0
    assert ask_openai(knobs, "alpha", fresh_plain, "in_memory") == 0

    knobs.restart_worker()  # an empty pool: what is read now comes from the shared tier
    back, _ = ask_anthropic(knobs, "alpha", stream=True)
    assert adds_up(back, num_prompt)
    assert back.cache_read_input_tokens == created.cache_creation_input_tokens  # up to the last breakpoint
    assert ask_openai(knobs, "alpha", fresh_24h) > 0  # kept a day; read back without asking again
    assert ask_openai(knobs, "alpha", fresh_plain) == 0  # in_memory: it died with the worker
    other, _ = ask_anthropic(knobs, "bravo")  # the same prompt, another tenant: none of alpha's
    assert (
        other.cache_read_input_tokens == 0
        and other.cache_creation_input_tokens == created.cache_creation_input_tokens
    )


def replicas(knobs: Knobs) -> list[pb.Replica]:
    router = worker_pb2_grpc.RouterStub(grpc.insecure_channel(knobs.stack.router_address))
    auth = (("authorization", f"Bearer {TOKEN}"),)
    return list(router.Replicas(pb.ReplicasRequest(), metadata=auth, timeout=5).replicas)


def results_written(knobs: Knobs, tenant: str) -> float:
    wanted = f'kvrelay_codec_result_cache_bytes_total{{direction="written",tenant="{tenant}"}} '
    text = httpx.get(f"{knobs.stack.base_url}/metrics", headers=bearer(knobs, "alpha")).text
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted)), 0.0)


def forced_call(knobs: Knobs, tenant: str) -> tuple[Any, str | None]:
    """A greedy chat completion forced to call get_weather, asking for the result cache; its header."""
    raw = knobs.openai(tenant).chat.completions.with_raw_response.create(
        model=model_of(knobs),
        messages=[{"role": "user", "content": "What is the weather like in Paris today?"}],
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0.0,
        extra_headers={"x-kvrelay-result-cache": "use"},
    )
    return raw.parse(), raw.headers.get("x-kvrelay-result-cache")


def test_a_repeated_call_is_replayed_without_the_engine_and_another_tenant_misses(knobs: Knobs) -> None:
    before = results_written(knobs, "alpha")
    first, header = forced_call(knobs, "alpha")
    assert header == "miss" and first.choices[0].finish_reason == "tool_calls"
    [worker] = replicas(knobs)
    mode = "_det" if worker.info.numerics == "deterministic" else ""
    assert first.system_fingerprint == f"fp_{worker.info.model_fingerprint[:12]}{mode}"
    wait_until(lambda: results_written(knobs, "alpha") > before, 30, "the result stored")
    served = worker.load.requests_total
    again, header = forced_call(knobs, "alpha")
    assert header == "hit"
    assert replicas(knobs)[0].load.requests_total == served  # the engine never saw it
    [call] = first.choices[0].message.tool_calls or []
    [replayed] = again.choices[0].message.tool_calls or []
    assert replayed.function == call.function  # the same name and arguments
    assert replayed.id != call.id and again.id != first.id  # minted fresh
    assert again.usage is not None and first.usage is not None
    assert (again.usage.prompt_tokens, again.usage.completion_tokens) == (
        first.usage.prompt_tokens,
        first.usage.completion_tokens,
    )
    other, header = forced_call(knobs, "bravo")
    assert header == "miss"  # its own key (the tenant salt is in it) under its own prefix
    assert replicas(knobs)[0].load.requests_total == served + 1
    [theirs] = other.choices[0].message.tool_calls or []
    assert theirs.function == call.function  # greedy: the same call, computed again
