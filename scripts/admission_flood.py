"""A bounded loopback flood against a real stack: one tenant at ten times its quota, another measured.

Starts a worker, a router and a codec (separate processes, the prepared model) with two API keys:
tenant "flooder" with `requests_per_minute` = --quota-rpm and `max_concurrency` = --flooder-concurrency,
and tenant "other" with no quota of its own. Then:

1. unloaded: "other" sends --probes streamed chat requests one after another; TTFT is the time to the
   first SSE event (the codec sends it once the first token exists);
2. loaded: the same probes again, while "flooder" sends --flood-factor × quota requests, spread over
   --flood-seconds, at most --flood-concurrency in flight;
3. end state, once every client is done: the codec's running and queued requests, open quota
   reservations and their tokens, its established client connections, and the worker's running and
   waiting requests and active KV blocks; beside it, the step timeouts and how many gaps between two
   tokens of one request (all tenants) were over 0.5, 1 and 2.5 s, to judge limits.step_timeout_ms.

--flood-prompt-words pads the flooder's prompt, so its prefills run in 512-token chunks beside the
other tenant's decodes.

Prints one JSON document (and writes it to --json). Exits 1 unless the flooder got 429s, "other" got
no errors and the end state is all zero. Bounded: every request has a timeout and the whole run a
deadline (--deadline-seconds).

    .venv/bin/python scripts/admission_flood.py --json bench-out/admission_flood.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from services.codec.auth import KeyRecord, key_digest, new_key, write_keys_file  # noqa: E402
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb  # noqa: E402
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc  # noqa: E402

TOKEN = "admission-flood-token"
KVRELAY = [sys.executable, "-m", "services.cli.main"]
PROBE = [{"role": "user", "content": "Name three colours."}]
FLOOD = [{"role": "user", "content": "Write a short sentence about the sea."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Proc:
    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log_path = log
        self._log = log.open("wb")
        self.popen = subprocess.Popen(
            KVRELAY + args,
            cwd=REPO_ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        self._log.close()

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


def wait_grpc(address: str, proc: Proc, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise RuntimeError(f"{proc.log_path.name} exited:\n{proc.tail()}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status == 1:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"{address} not serving:\n{proc.tail()}")


def wait_http(url: str, proc: Proc, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"codec exited:\n{proc.tail()}")
        try:
            if httpx.get(f"{url}/ready", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready:\n{proc.tail()}")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[rank] * 1000, 1)


async def streamed(
    client: httpx.AsyncClient, key: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[int, float | None]:
    """(status, seconds to the first SSE event) of one streamed chat request."""
    body = {"model": "flood", "messages": messages, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    ttft: float | None = None
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    ) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, None
        async for line in response.aiter_lines():
            if line.startswith("data: ") and ttft is None:
                ttft = time.perf_counter() - started
            if '"error"' in line:
                return 500, ttft
    return 200, ttft


async def probes(url: str, key: str, count: int, max_tokens: int) -> dict[str, Any]:
    ttfts: list[float] = []
    errors: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=120.0) as client:
        for _ in range(count):
            try:
                status, ttft = await streamed(client, key, PROBE, max_tokens)
            except httpx.HTTPError as exc:
                errors.append(type(exc).__name__)
                continue
            if status != 200 or ttft is None:
                errors.append(str(status))
            else:
                ttfts.append(ttft)
    return {
        "requests": count,
        "errors": errors,
        "ttft_p50_ms": percentile(ttfts, 50),
        "ttft_p99_ms": percentile(ttfts, 99),
        "ttft_mean_ms": round(statistics.fmean(ttfts) * 1000, 1) if ttfts else None,
    }


async def flood(
    url: str, key: str, total: int, seconds: float, concurrency: int, max_tokens: int, padding: int
) -> dict[str, Any]:
    messages = [{"role": "user", "content": FLOOD[0]["content"] + " sea" * padding}]
    statuses: dict[str, int] = {}
    retry_after: list[int] = []
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(
        base_url=url, timeout=120.0, limits=httpx.Limits(max_connections=concurrency)
    ) as client:

        async def one(delay: float) -> None:
            await asyncio.sleep(delay)
            async with gate:
                try:
                    body = {"model": "flood", "messages": messages, "max_tokens": max_tokens}
                    r = await client.post(
                        "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
                    )
                    status = str(r.status_code)
                    if r.status_code == 429:
                        retry_after.append(int(r.headers["retry-after"]))
                except httpx.HTTPError as exc:
                    status = type(exc).__name__
                statuses[status] = statuses.get(status, 0) + 1

        await asyncio.gather(*(one(i * seconds / total) for i in range(total)))
    return {
        "sent": total,
        "statuses": statuses,
        "retry_after_s_min_max": [min(retry_after), max(retry_after)] if retry_after else None,
    }


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def token_gaps(text: str) -> dict[str, float]:
    """How many gaps between two tokens of one request were over 0.5, 1 and 2.5 s (codec histogram)."""
    name = "kvrelay_inter_token_latency_seconds_bucket"
    pattern = rf'^{name}{{le="([^"]+)"}} (\S+)$'
    buckets = {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.MULTILINE)}
    total = buckets.get("+Inf", 0.0)
    return {
        "gaps": total,
        "over_0_5_s": total - buckets.get("0.5", total),
        "over_1_s": total - buckets.get("1.0", total),
        "over_2_5_s": total - buckets.get("2.5", total),
    }


def end_state(url: str, codec: Proc, codec_port: int, worker: str) -> dict[str, Any]:
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    connections = [
        c
        for c in psutil.Process(codec.popen.pid).net_connections(kind="tcp")
        if c.laddr and c.laddr.port == codec_port and c.status == psutil.CONN_ESTABLISHED
    ]
    with grpc.insecure_channel(worker) as channel:
        load = worker_pb2_grpc.WorkerStub(channel).Load(
            pb.LoadRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=5.0
        )
    return {
        "codec_running": metric(text, "kvrelay_admission_running"),
        "codec_queued": metric(text, "kvrelay_admission_queued"),
        "quota_open_reservations": metric(text, "kvrelay_quota_open_reservations"),
        "quota_reserved_tokens": metric(text, "kvrelay_quota_reserved_tokens"),
        "codec_client_connections": len(connections),
        "worker_running": load.running,
        "worker_waiting": load.waiting,
        "worker_kv_blocks_active": load.kv_blocks.active,
        "step_timeouts": metric(text, "kvrelay_step_timeouts_total"),
        "token_gaps": token_gaps(text),
    }


def settled(state: dict[str, Any]) -> bool:
    return all(state[k] == 0 for k in state if k not in ("step_timeouts", "token_gaps"))


async def measure(args: argparse.Namespace, url: str, keys: dict[str, str]) -> dict[str, Any]:
    await probes(url, keys["other"], 2, args.max_tokens)  # warm-up
    unloaded = await probes(url, keys["other"], args.probes, args.max_tokens)
    total = args.flood_factor * args.quota_rpm
    flood_task = asyncio.create_task(
        flood(
            url,
            keys["flooder"],
            total,
            args.flood_seconds,
            args.flood_concurrency,
            args.max_tokens,
            args.flood_prompt_words,
        )
    )
    await asyncio.sleep(min(2.0, args.flood_seconds / 4))  # let the flood build up first
    loaded = await probes(url, keys["other"], args.probes, args.max_tokens)
    flooded = await flood_task
    return {"unloaded": unloaded, "loaded": loaded, "flooder": flooded}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(REPO_ROOT / "models" / "smollm2-135m-instruct"))
    parser.add_argument("--quota-rpm", type=int, default=20, help="the flooder's requests per minute")
    parser.add_argument("--flood-factor", type=int, default=10)
    parser.add_argument("--flood-seconds", type=float, default=20.0, help="the flood is spread over this")
    parser.add_argument("--flood-concurrency", type=int, default=32, help="flood requests in flight, at most")
    parser.add_argument("--flooder-concurrency", type=int, default=2, help="the flooder's max_concurrency")
    parser.add_argument("--probes", type=int, default=30, help="the other tenant's requests per phase")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--flood-prompt-words", type=int, default=0, help="pad the flooder's prompt")
    parser.add_argument("--deadline-seconds", type=float, default=600.0)
    parser.add_argument("--json", default=None, help="also write the result here")
    parser.add_argument("--logs", default=None, help="keep the processes' logs in this directory")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="admission-flood-"))
    logs = Path(args.logs) if args.logs else work
    logs.mkdir(parents=True, exist_ok=True)
    keys: dict[str, str] = {}
    records = []
    for tenant in ("flooder", "other"):
        key_id, key = new_key()
        keys[tenant] = key
        records.append(KeyRecord(key_id=key_id, tenant=tenant, sha256=key_digest(key)))
    write_keys_file(work / "keys.yaml", records)
    quota = {"requests_per_minute": args.quota_rpm, "max_concurrency": args.flooder_concurrency}
    config = {
        "model": {"served_name": "flood"},
        "auth": {"keys_file": str(work / "keys.yaml")},
        "quotas": {"tenants": {"flooder": quota}},
    }
    (work / "codec.yaml").write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(KVRELAY_INTERNAL_TOKEN=TOKEN, KVRELAY_MODEL__DTYPE="float32", PYTHONUNBUFFERED="1")
    worker, router, codec_port = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", free_port()
    url = f"http://127.0.0.1:{codec_port}"
    procs: list[Proc] = []
    try:
        procs.append(
            Proc(
                ["worker", "--model", args.model_dir, "--port", worker.split(":")[1]],
                env,
                logs / "worker.log",
            )
        )
        wait_grpc(worker, procs[-1])
        procs.append(
            Proc(["router", "--port", router.split(":")[1], "--workers", worker], env, logs / "router.log")
        )
        wait_grpc(router, procs[-1])
        codec_args = ["codec", "--config", str(work / "codec.yaml"), "--model", args.model_dir]
        procs.append(
            Proc([*codec_args, "--router", router, "--port", str(codec_port)], env, logs / "codec.log")
        )
        codec = procs[-1]
        wait_http(url, codec)
        started = time.monotonic()
        result = asyncio.run(asyncio.wait_for(measure(args, url, keys), args.deadline_seconds))
        state = end_state(url, codec, codec_port, worker)
        deadline = time.monotonic() + 10
        while not settled(state) and time.monotonic() < deadline:  # connections close asynchronously
            time.sleep(0.5)
            state = end_state(url, codec, codec_port, worker)
        result["end_state"] = state
        result["seconds"] = round(time.monotonic() - started, 1)
        result["config"] = {
            "quota_rpm": args.quota_rpm,
            "flood_requests": args.flood_factor * args.quota_rpm,
            "flood_seconds": args.flood_seconds,
            "flood_concurrency": args.flood_concurrency,
            "flooder_max_concurrency": args.flooder_concurrency,
            "probes": args.probes,
            "max_tokens": args.max_tokens,
            "flood_prompt_words": args.flood_prompt_words,
        }
    finally:
        for proc in reversed(procs):
            proc.stop()
    flooded = result["flooder"]["statuses"]
    ok = (
        flooded.get("429", 0) > 0
        and not result["unloaded"]["errors"]
        and not result["loaded"]["errors"]
        and settled(result["end_state"])
    )
    result["ok"] = ok
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
