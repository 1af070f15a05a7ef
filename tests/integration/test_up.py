"""`kvrelay up` on the real model: the whole stack as one command, `kvrelay status`, two stacks side by
side, a killed worker coming back, SIGTERM ending every child, and the disaggregated shape (one prefill
and one decode worker) answering a chat request with the KV pulled across."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO_ROOT
from tests.ports import free_port_run

pytestmark = pytest.mark.model

KVRELAY = [sys.executable, "-m", "services.cli.main"]
READY_TIMEOUT_S = 120.0
# The step timeout is wide: a loaded CI machine (two stacks beside another test, 2 cores) can take seconds
# a step, and these tests check the processes, not how fast a step is (2 s cut one off once).
CONFIG = (
    "engine:\n  kv_cache_memory_mb: 128\n  max_model_len: 2048\ndisaggregation:\n  policy: always\n"
    "limits:\n  step_timeout_ms: 30000\n  request_timeout_ms: 40000000\n"
)


@dataclass
class UpStack:
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def children(self) -> dict[str, int]:
        """PID of each service process by subcommand (worker, router, codec), from /proc."""
        return dict(self.child_processes())

    def child_processes(self) -> list[tuple[str, int]]:
        """(subcommand, PID) of every service process, from /proc: several workers appear once each."""
        found: list[tuple[str, int]] = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except (OSError, IndexError, ValueError):
                continue
            if ppid == self.proc.pid and len(argv) > 3:
                found.append((argv[3].decode(), int(entry.name)))
        return found

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM `kvrelay up`; if it hangs, kill it and every child it left (by PID)."""
        children = dict(enumerate(pid for _, pid in self.child_processes()))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                for pid in [self.proc.pid, *children.values()]:
                    _kill(pid)
                self.proc.wait()
        return self.proc.returncode


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def wait_until(condition: Callable[[], bool], stack: UpStack, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if stack.proc.poll() is not None:
            raise RuntimeError(f"kvrelay up exited with {stack.proc.returncode}:\n{stack.log()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} after {timeout_s}s:\n{stack.log()}")
        time.sleep(0.3)


def is_ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


ANNOUNCED = re.compile(r"kvrelay ready on (http://\S+)")


def start_up(
    model_dir: Path, workdir: Path, *extra: str, free_ports: bool = False, config_text: str = CONFIG
) -> UpStack:
    """`kvrelay up` with `extra` flags, waited on until it announces its URL. The base port is a free run
    of ports, or 0 (`free_ports`: every service takes any free port, the URL comes from the announcement)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "config.yaml"
    config.write_text(config_text)
    base = 0 if free_ports else free_port_run(3)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")} | {"PYTHONUNBUFFERED": "1"}
    argv = ["up", "--port", str(base), "--model", str(model_dir), "--config", str(config), *extra]
    log_path = workdir / "up.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [*KVRELAY, *argv, "--grace-seconds", "10"],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stack = UpStack(proc, f"http://127.0.0.1:{base}", log_path)
    try:
        wait_until(lambda: _announced_url(stack) is not None, stack, "not announced", READY_TIMEOUT_S)
        url = _announced_url(stack)
        assert url is not None and (free_ports or url == stack.url), url
        stack.url = url
        assert is_ready(stack.url)
    except BaseException:
        stack.stop()
        raise
    return stack


def _announced_url(stack: UpStack) -> str | None:
    found = ANNOUNCED.search(stack.log_path.read_text(errors="replace"))
    return found.group(1) if found else None


@pytest.fixture(scope="module")
def stack(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    running = start_up(model_dir, tmp_path_factory.mktemp("up-a"))
    yield running
    running.stop()


def complete(url: str, prompt: str = "The capital of France is") -> dict[str, Any]:
    model = httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 5, "temperature": 0}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60.0)
    assert reply.status_code == 200, reply.text
    document: dict[str, Any] = reply.json()
    return document


def status_json(url: str) -> dict[str, Any]:
    result = subprocess.run(
        [*KVRELAY, "status", "--json", "--url", url], cwd=REPO_ROOT, capture_output=True, timeout=60
    )
    assert result.returncode == 0, result.stderr.decode()
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def test_up_starts_the_stack_and_status_lists_every_service(stack: UpStack) -> None:
    assert set(stack.children()) == {"worker", "router", "codec"}
    services = status_json(stack.url)["services"]
    roles = {str(s["role"]) for s in services}
    assert {"codec", "router"} <= roles and roles & {"worker", "colocated"}
    worker = next(s for s in services if s["role"] in ("worker", "colocated"))
    assert worker["ready"] is True
    kv = worker["kv_blocks"]
    assert isinstance(kv, dict) and set(kv) >= {"total", "active", "cached", "free"} and kv["total"] > 0
    assert {"queries", "hits"} <= set(worker["prefix_cache"])
    # what the worker serves its model from, and its steps by path (the warm-up's at least)
    assert worker["weights"] in ("gguf-hybrid", "gguf-int8", "safetensors") and worker["weight_bytes"] > 0
    assert sum(worker["steps_by_path"].values()) >= 1
    table = subprocess.run([*KVRELAY, "status", "--url", stack.url], cwd=REPO_ROOT, capture_output=True)
    assert table.returncode == 0 and b"worker" in table.stdout


def test_the_internal_token_reaches_children_only_through_their_environment(stack: UpStack) -> None:
    children = stack.children()
    environ = Path(f"/proc/{children['worker']}/environ").read_bytes().split(b"\0")
    token = next(v.split(b"=", 1)[1] for v in environ if v.startswith(b"KVRELAY_INTERNAL_TOKEN="))
    assert len(token) >= 32
    for pid in [stack.proc.pid, *children.values()]:
        assert token not in Path(f"/proc/{pid}/cmdline").read_bytes()
    assert token.decode() not in stack.log_path.read_text(errors="replace")


def test_a_completion_goes_through_the_stack(stack: UpStack) -> None:
    reply = complete(stack.url)
    assert reply["choices"][0]["text"]
    assert reply["usage"]["completion_tokens"] == 5


def test_two_stacks_side_by_side_and_sigterm_ends_every_child(
    stack: UpStack, model_dir: Path, tmp_path: Path
) -> None:
    other = start_up(model_dir, tmp_path / "up-b")
    try:
        assert other.url != stack.url
        assert complete(other.url)["choices"] and complete(stack.url)["choices"]
        children = other.children()
        assert set(children) == {"worker", "router", "codec"}
    finally:
        code = other.stop()
    assert code == 0, other.log()
    assert not any(is_alive(pid) for pid in children.values())
    assert is_ready(stack.url)


def test_a_killed_worker_is_restarted_and_the_stack_is_ready_again(stack: UpStack) -> None:
    old_pid = stack.children()["worker"]
    os.kill(old_pid, signal.SIGKILL)
    wait_until(lambda: stack.children().get("worker", old_pid) != old_pid, stack, "no new worker", 30)
    wait_until(lambda: is_ready(stack.url), stack, "not ready again", READY_TIMEOUT_S)
    wait_until(lambda: _completes(stack.url), stack, "no completion after the restart", 60)
    assert not is_alive(old_pid)


def _stream_until_end(url: str, model: str, started: threading.Event, outcomes: list[str]) -> None:
    """One streamed chat request; its outcome: done ([DONE] after content), error (an error event in the
    protocol's shape, or a refusal before the stream), or broken (anything else: a cut, a non-JSON line)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "ignore_eos": True, "stream": True}  # fmt: skip
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=90.0) as reply:
            if reply.status_code != 200:
                error = json.loads(reply.read()).get("error", {})
                outcomes.append("error" if reply.status_code >= 500 and error.get("message") else "broken")
                return
            for line in reply.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    outcomes.append("done")
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    outcomes.append("error" if event["error"].get("message") else "broken")
                    return
                started.set()
        outcomes.append("broken")  # the stream ended with neither [DONE] nor an error event
    except (httpx.HTTPError, ValueError) as exc:
        outcomes.append(f"broken: {type(exc).__name__}")


def test_the_router_killed_under_load_ends_streams_cleanly_and_the_stack_frees_everything(
    stack: UpStack,
) -> None:
    """The router SIGKILLed while four streams run: each ends with an error event in OpenAI's shape (none
    hangs, none is cut without one), `kvrelay up` restarts the router, new requests complete, and nothing
    stays held: no running request and no active KV block anywhere, the codec's admission back to zero."""
    model = httpx.get(f"{stack.url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    old_pid = stack.children()["router"]
    outcomes: list[str] = []
    started = [threading.Event() for _ in range(4)]
    clients = [
        threading.Thread(target=_stream_until_end, args=(stack.url, model, s, outcomes)) for s in started
    ]
    for client in clients:
        client.start()
    for event in started:
        assert event.wait(60), f"a stream never started:\n{stack.log()}"
    os.kill(old_pid, signal.SIGKILL)
    for client in clients:
        client.join(90)
    assert not any(c.is_alive() for c in clients), "a stream hung past the router's death"
    assert sorted(outcomes) == ["error"] * 4, outcomes

    wait_until(lambda: stack.children().get("router", old_pid) != old_pid, stack, "no new router", 30)
    wait_until(lambda: _completes(stack.url), stack, "no completion after the router came back", 60)

    def nothing_held() -> bool:
        services = status_json(stack.url)["services"]
        if {s["role"] for s in services} != {"codec", "router", "colocated"}:
            return False  # the router did not answer: its and the worker's counts are not in
        return all(int(s.get("running") or 0) == 0 for s in services) and all(
            int((s.get("kv_blocks") or {}).get("active") or 0) == 0 for s in services
        )

    wait_until(nothing_held, stack, "a request or KV block still held", 30)
    metrics = httpx.get(f"{stack.url}/metrics", timeout=10.0).text
    assert re.search(r"^kvrelay_admission_running 0\.0$", metrics, re.MULTILINE), "the codec still counts one"


def _completes(url: str) -> bool:
    try:
        complete(url)
    except (AssertionError, httpx.HTTPError):
        return False
    return True


def test_disaggregated_up_answers_a_chat_and_status_shows_both_pools(model_dir: Path, tmp_path: Path) -> None:
    split = start_up(model_dir, tmp_path / "up-pd", "--mode", "disaggregated", free_ports=True)
    try:
        pids = [pid for _, pid in split.child_processes()]
        assert sorted(name for name, _ in split.child_processes()) == ["codec", "router", "worker", "worker"]
        answer = chat(split.url, "What is the capital of France?")
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] >= 1

        # The router refreshes each replica's load about once a second: the counters may lag the answer.
        # ...and each worker's counters reach the status on their own refresh: wait for both sides'.
        def counted() -> bool:
            return _remote_prefills(split.url, "decode") >= 1 and _remote_prefills(split.url, "prefill") >= 1

        wait_until(counted, split, "no remote prefill counted on both sides", 15)
        services = status_json(split.url)["services"]
        workers = [s for s in services if s["role"] in ("prefill", "decode", "colocated")]
        assert sorted(s["role"] for s in workers) == ["decode", "prefill"]
        assert all(s["ready"] is True for s in workers)
        decode = next(s for s in workers if s["role"] == "decode")
        assert decode["kv_transfer_bytes_total"] > 0
        assert decode["prefill_fallbacks_total"] == 0
        prefill = next(s for s in workers if s["role"] == "prefill")
        assert prefill["remote_prefills_total"] >= 1
        table = subprocess.run([*KVRELAY, "status", "--url", split.url], cwd=REPO_ROOT, capture_output=True)
        assert table.returncode == 0 and b"prefill" in table.stdout and b"decode" in table.stdout
    finally:
        code = split.stop()
    assert code == 0, split.log()
    assert not any(is_alive(pid) for pid in pids)


def chat(url: str, question: str) -> dict[str, Any]:
    model = httpx.get(f"{url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 8}
    reply = httpx.post(f"{url}/v1/chat/completions", json={**body, "temperature": 0}, timeout=60.0)
    assert reply.status_code == 200, reply.text
    document: dict[str, Any] = reply.json()
    return document


def _remote_prefills(url: str, role: str) -> int:
    """The remote prefills of the workers in `role` (decode: asked for; prefill: served), as `kvrelay
    status --json` reports them (a KeyError, at once, if the status document does not carry the counter)."""
    services = status_json(url)["services"]
    return sum(int(s["remote_prefills_total"]) for s in services if s["role"] == role)
