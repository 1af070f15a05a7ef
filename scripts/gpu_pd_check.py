"""Prefill/decode disaggregation over the "torch" KV transport on a GPU machine: token identity and rate.

    .venv/bin/python scripts/gpu_pd_check.py MODEL_DIR [--transport torch] [--lengths 512,2000]

Starts three `kvrelay worker` processes on loopback, each with `KVRELAY_DISAGGREGATION__TRANSPORT`
set and a fresh `KVRELAY_INTERNAL_TOKEN`: a prefill replica P (`--role prefill`), a decode replica D
(`--role decode`) and a colocated reference C. For every prompt length (synthetic token ids drawn from
the model's vocabulary, fixed seed, `--repeats` different prompts per length so P's prefix cache never
serves a repeat) it sends the same greedy request to D, with `GenerateRequest.remote_prefill` naming P
and the transport, and to C, then checks that D's tokens equal C's and that D used P's KV
(PREFILL_MODE_REMOTE, no fallback). The last GenerateResponse of each D stream carries
`kv_transfer_bytes` and `kv_transfer_seconds`; the report gives their ratio in GB/s. Output: one JSON
object on stdout (worker logs stay in `--logs`, printed in the JSON); exit status 0 when every run was
identical and remote, 1 otherwise, 2 if a worker did not come up.

GPU placement: with two or more visible GPUs P runs with CUDA_VISIBLE_DEVICES=<first>, D with <second>
and C with <first>; with one, all share it (NCCL then cannot pair P and D: it refuses two ranks on one
GPU).

What this measures today: the engine keeps its weights and KV cache in host memory
(services/engine/core.py allocates the cache with `torch.device("cpu")`; there is no CUDA placement
yet), so the workers ignore the GPUs, the exported KV is a CPU tensor and the torch transport takes its
gloo path between two processes over loopback TCP. The numbers are then this host's CPU path, not NCCL;
the report says which backend the workers logged ("kv pair group ready"). Once the engine places the KV
cache on CUDA (and D's `TorchReceiver` gets `device="cuda"`), the same script exercises NCCL unchanged.
Also note what the rate includes: `kv_transfer_seconds` runs from D's Prefill call to the KV installed on
D, so it contains P's prefill compute. `gb_per_s_after_first_token` divides by that time less the
client's time to first token (the header arrives right after P's prefill), an estimate of the transfer
alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
ROLES = ("prefill", "decode", "colocated")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("model_dir", type=Path, help="prepared model directory (with manifest.json)")
    p.add_argument("--transport", choices=["torch", "grpc"], default="torch")
    p.add_argument("--lengths", default="512,2000", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="prompts per length (the first builds the pair)")
    p.add_argument("--max-tokens", type=int, default=32, help="greedy tokens generated per request")
    p.add_argument("--dtype", default="float32", help="KVRELAY_MODEL__DTYPE for all workers")
    p.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    p.add_argument("--kv-cache-mb", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--logs", type=Path, default=None, help="worker log directory (default: a temp dir)")
    return p.parse_args(argv)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gpu_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"cuda": False}
    if not torch.cuda.is_available():
        return {"cuda": False}
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"cuda": True, "devices": names}


class Worker:
    def __init__(self, role: str, args: argparse.Namespace, env: dict[str, str], logs: Path) -> None:
        self.role = role
        self.address = f"127.0.0.1:{free_port()}"
        self.log_path = logs / f"{role}.log"
        command = [sys.executable, "-m", "services.cli.main", "worker", "--model", str(args.model_dir)]
        command += ["--role", role, "--port", self.address.split(":")[1], "--name", role]
        if args.threads:
            command += ["--threads", str(args.threads)]
        with self.log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_serving(self, deadline: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.popen.poll() is not None:
                    raise RuntimeError(
                        f"{self.role} exited with {self.popen.returncode}; see {self.log_path}"
                    )
                with contextlib.suppress(grpc.RpcError):
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.5)
        raise TimeoutError(f"{self.role} not serving at {self.address}; see {self.log_path}")

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()

    def kv_backends(self) -> list[str]:
        """The backends of the pair groups this worker built, from its JSON log lines."""
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if entry.get("msg") == "kv pair group ready":
                    found.append(str(entry.get("backend")))
        return found


def worker_env(args: argparse.Namespace, token: str, gpu: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")}
    env.update(
        {
            "KVRELAY_INTERNAL_TOKEN": token,
            "KVRELAY_DISAGGREGATION__TRANSPORT": args.transport,
            "KVRELAY_MODEL__DTYPE": args.dtype,
            "KVRELAY_ENGINE__KV_CACHE_MEMORY_MB": str(args.kv_cache_mb),
            "KVRELAY_ENGINE__MAX_MODEL_LEN": str(args.max_model_len),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def gpu_assignment() -> dict[str, str | None]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g for g in visible.split(",") if g] if visible else None
    if ids is None:
        info = gpu_info()
        ids = [str(i) for i in range(len(info.get("devices", [])))]
    if not ids:
        return dict.fromkeys(ROLES)
    second = ids[1] if len(ids) > 1 else ids[0]
    return {"prefill": ids[0], "decode": second, "colocated": ids[0]}


def generate(address: str, token: str, request: Any, timeout: float) -> tuple[list[int], Any, float, float]:
    """Tokens, the last response, seconds to the first response, and seconds in all."""
    import grpc

    from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

    metadata = (("authorization", f"Bearer {token}"),)
    tokens: list[int] = []
    last = None
    started = time.monotonic()
    first_at = 0.0
    with grpc.insecure_channel(address) as channel:
        for response in worker_pb2_grpc.WorkerStub(channel).Generate(
            request, metadata=metadata, timeout=timeout
        ):
            if not tokens:
                first_at = time.monotonic() - started
            tokens.extend(response.token_ids)
            last = response
    return tokens, last, first_at, time.monotonic() - started


def run_checks(args: argparse.Namespace, workers: dict[str, Worker], token: str) -> list[dict[str, Any]]:
    import grpc

    from services.common.proto_convert import sampling_to_proto
    from services.common.sampling import SamplingParams
    from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
    from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

    with grpc.insecure_channel(workers["decode"].address) as channel:
        info = worker_pb2_grpc.WorkerStub(channel).Info(
            pb.InfoRequest(), metadata=(("authorization", f"Bearer {token}"),), timeout=30
        )
    vocab = info.vocab_size
    sampling = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True))
    runs = []
    for length in [int(n) for n in args.lengths.split(",")]:
        for repeat in range(args.repeats):
            rng = random.Random(length * 1000 + repeat)
            prompt = [rng.randrange(vocab // 10, vocab) for _ in range(length)]
            rid = f"pd-{length}-{repeat}"
            local = pb.GenerateRequest(request_id=f"{rid}-c", prompt_token_ids=prompt, sampling=sampling)
            want, _, _, _ = generate(workers["colocated"].address, token, local, args.request_timeout)
            remote = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
            remote.remote_prefill.address = workers["prefill"].address
            remote.remote_prefill.transport = args.transport
            got, last, ttft, total = generate(workers["decode"].address, token, remote, args.request_timeout)
            nbytes = int(last.kv_transfer_bytes) if last is not None else 0
            seconds = float(last.kv_transfer_seconds) if last is not None else 0.0
            after_first = seconds - ttft
            runs.append(
                {
                    "prompt_tokens": length,
                    "repeat": repeat,
                    "identical": got == want,
                    "num_tokens": len(got),
                    "prefill_mode": pb.PrefillMode.Name(last.prefill_mode) if last is not None else None,
                    "kv_transfer_bytes": nbytes,
                    "kv_transfer_seconds": round(seconds, 4),
                    "gb_per_s": round(nbytes / seconds / 1e9, 3) if seconds > 0 else None,
                    "ttft_seconds": round(ttft, 4),
                    "gb_per_s_after_first_token": round(nbytes / after_first / 1e9, 3)
                    if after_first > 0
                    else None,
                    "request_seconds": round(total, 3),
                }
            )
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="kvrelay-pd-check-"))
    logs.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO_ROOT))
    token = secrets.token_hex(16)
    gpus = gpu_assignment()
    workers: dict[str, Worker] = {}
    report: dict[str, Any] = {
        "transport": args.transport,
        "model_dir": str(args.model_dir),
        "dtype": args.dtype,
        "gpus": gpu_info(),
        "cuda_visible_devices": gpus,
        "kv_placement_note": "engine KV cache is allocated on CPU (services/engine/core.py): expect gloo",
        "logs": str(logs),
    }
    status = 0
    try:
        for role in ROLES:
            workers[role] = Worker(role, args, worker_env(args, token, gpus[role]), logs)
        deadline = time.monotonic() + args.startup_timeout
        for worker in workers.values():
            worker.wait_serving(deadline)
        runs = run_checks(args, workers, token)
        report["runs"] = runs
        report["kv_backends"] = {role: workers[role].kv_backends() for role in ("prefill", "decode")}
        ok = bool(runs) and all(r["identical"] and r["prefill_mode"] == "PREFILL_MODE_REMOTE" for r in runs)
        report["ok"] = ok
        status = 0 if ok else 1
    except (RuntimeError, TimeoutError) as exc:
        report["ok"] = False
        report["error"] = str(exc)
        status = 2
    finally:
        for worker in workers.values():
            worker.stop()
    print(json.dumps(report, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main())
