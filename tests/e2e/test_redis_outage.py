"""Redis going away under the real stack: quotas fail closed or fall back to this replica's share as
configured, Responses still answer (a finished response that cannot be stored is counted, not failed),
and no request outlives its deadline. Each test runs its own redis-server on a free port, stopped
(SIGKILL) or silent (SIGSTOP: it still accepts connections, the kernel queues them, it never answers);
the machine's Redis is never touched.

Two codec processes sit in front of the session stack's router, sharing the private Redis for quotas
(database 0) and stored Responses (database 1): `closed` with quotas.fail_open false, `open` with it
true; 6 requests per minute per tenant. Both serve once while Redis is up, so each has beaten into
Redis and `open` knows there are two replicas: with Redis gone, it admits 6 / 2 per minute on its own.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.conftest import TOKEN, RunningStack, wait_http_ready, worker_load
from tests.stack_helpers import Proc, free_port, stack_env, wait_until

pytestmark = [pytest.mark.model, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
RPM = 6
DEADLINE_S = 15.0  # the client's own timeout: a request that hangs on a dead Redis fails the test here


def chat() -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def respond() -> dict[str, Any]:
    return {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": True}


@dataclass
class Outage:
    redis: subprocess.Popen[bytes]
    port: int
    codecs: dict[str, tuple[str, Proc]]

    def url(self, name: str) -> str:
        return self.codecs[name][0]

    def metric(self, name: str, sample: str) -> float:
        for line in httpx.get(f"{self.url(name)}/metrics", timeout=5).text.splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[1])
        return 0.0


@pytest.fixture
def outage(stack: RunningStack, model_dir: Path, tmp_path: Path) -> Iterator[Outage]:
    port = free_port()
    server = shutil.which("redis-server") or "/usr/bin/redis-server"
    redis_proc = subprocess.Popen(
        [server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port, socket_timeout=1)
    wait_until(lambda: _pings(client), 10.0, "the private redis-server answers")
    common = {
        "KVRELAY_MODEL__DTYPE": "float32",
        "KVRELAY_QUOTAS__BACKEND": "redis",
        "KVRELAY_QUOTAS__REDIS_URL": f"redis://127.0.0.1:{port}/0",
        "KVRELAY_QUOTAS__DEFAULT_REQUESTS_PER_MINUTE": str(RPM),
        "KVRELAY_RESPONSES__REDIS_URL": f"redis://127.0.0.1:{port}/1",
    }
    codecs: dict[str, tuple[str, Proc]] = {}
    try:
        for name, fail_open in (("closed", "false"), ("open", "true")):
            env = stack_env(TOKEN, **common, KVRELAY_QUOTAS__FAIL_OPEN=fail_open)
            http_port = free_port()
            args = [
                "codec",
                "--model",
                str(model_dir),
                "--router",
                stack.router_address,
                "--port",
                str(http_port),
            ]
            codecs[name] = (f"http://127.0.0.1:{http_port}", Proc(args, env, tmp_path / f"codec-{name}.log"))
        for url, proc in codecs.values():
            wait_http_ready(url, proc)
        yield Outage(redis_proc, port, codecs)
    finally:
        for _, proc in codecs.values():
            proc.stop()
        redis_proc.send_signal(signal.SIGCONT)
        redis_proc.kill()
        redis_proc.wait()
        client.close()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


@pytest.mark.parametrize("how", ["stopped", "silent"])
def test_quotas_and_responses_when_redis_goes(outage: Outage, stack: RunningStack, how: str) -> None:
    with httpx.Client(timeout=DEADLINE_S) as http:
        # Redis up: both replicas serve (and beat into Redis), a stored response reads back.
        for name in ("closed", "open"):
            assert http.post(f"{outage.url(name)}/v1/chat/completions", json=chat()).status_code == 200
        stored = http.post(f"{outage.url('open')}/v1/responses", json=respond())
        assert stored.status_code == 200, stored.text
        assert http.get(f"{outage.url('closed')}/v1/responses/{stored.json()['id']}").status_code == 200

        if how == "stopped":
            outage.redis.kill()
            outage.redis.wait()
        else:
            outage.redis.send_signal(signal.SIGSTOP)

        refused = http.post(f"{outage.url('closed')}/v1/chat/completions", json=chat())
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] and "quota store" in refused.json()["error"]["message"]
        assert int(refused.headers["retry-after"]) >= 1

        # fail open: this replica's share, 6 per minute / 2 replicas seen alive = 3 here
        for _ in range(2):
            assert http.post(f"{outage.url('open')}/v1/chat/completions", json=chat()).status_code == 200
        # a generation that happened is answered though it cannot be stored: logged and counted
        answered = http.post(f"{outage.url('open')}/v1/responses", json=respond())
        assert answered.status_code == 200, answered.text
        assert answered.json()["status"] == "incomplete"  # max_output_tokens: 2
        assert answered.json()["output"][0]["content"][0]["text"]
        over = http.post(f"{outage.url('open')}/v1/chat/completions", json=chat())
        assert over.status_code == 429, over.text
        # where a stored record is needed, the store's outage is a 503 in the protocol's shape
        lookup = http.get(f"{outage.url('open')}/v1/responses/{stored.json()['id']}")
        assert lookup.status_code == 503, lookup.text
        assert "stored responses are unavailable" in lookup.json()["error"]["message"]

    errors = 'kvrelay_codec_response_store_errors_total{operation="put"}'
    assert outage.metric("open", errors) == 1.0
    wait_until(lambda: worker_load(stack).running == 0, 30.0, "the worker drained")
