"""`kvrelay up`: the whole stack on one machine (workers, router, codec), supervised until Ctrl-C.

Two shapes (`--mode`): colocated (default), `--workers N` processes that each prefill and decode; and
disaggregated, `--prefill-replicas P` prefill workers then `--decode-replicas M` decode workers (1 each by
default), which the router pairs per request (the decode replica pulls the prompt's KV from a prefill one).
Every worker gets `--role` and an even share of the cores (`threads_per_worker`).

Ports come from one base: codec = base (the public HTTP port), router = base + 1, worker i = base + 2 + i
(in disaggregated mode the prefill workers come first, then the decode ones); `--port 0` takes a free
port for each. Internal services listen on 127.0.0.1 only. A random internal
token reaches the children through the environment (KVRELAY_INTERNAL_TOKEN): never on argv, never logged.
Every child gets the same validated config, written to a temporary file for the stack's lifetime.

The plan (worker slots, ports, the thread split, the children's command lines and probes) is
services/common/local_stack.py, which the benchmarks' stacks share; the supervisor that runs it is
services/common/supervisor.py. This module adds the flags, the GPU share, the busy-port check, the KV
cache's own redis-server when `kv_tiers.shared_url` names this machine and nothing answers there
(services/common/cache_redis.py), likewise the queue's (queue.url: a redis-server of the queue role whose
append-only file outlives the stack, under $XDG_STATE_HOME/kvrelay), and the foreground run. With
queue.url set the codec also drains the queue (`kvrelay codec --drain`, docs/async.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import socket
import tempfile
from pathlib import Path

from services.common.cache_redis import local_cache_redis, local_queue_redis
from services.common.config import KV_TIERS_PASSWORD_ENV, KvrelayConfig, load_config
from services.common.errors import ModelNotFoundError
from services.common.local_stack import (
    COLOCATED,
    DISAGGREGATE_FROM_CORES,
    INTERNAL_HOST,
    StackPlan,
    StackPorts,
    UpError,
    available_cores,
    build_specs,
    child_env,
    derive_ports,
    free_ports,
    plan_workers,
    public_url,
    resolve_mode,
    threads_per_worker,
    write_stack_config,
)
from services.common.logs import configure_logging
from services.common.supervisor import Supervisor, SupervisorOptions

log = logging.getLogger(__name__)

DEFAULT_GRACE_S = 30.0
# Where a queue Redis that `kvrelay up` starts keeps its append-only file (queue.url on this machine).
QUEUE_DATA_DIR = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "kvrelay"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="run the whole stack locally (workers, router, codec), supervised")
    p.add_argument(
        "--mode",
        default=COLOCATED,
        help="deployment shape: colocated (default; each worker prefills and decodes), disaggregated "
        f"(prefill workers and decode workers), or auto (`make serve`: disaggregated from "
        f"{DISAGGREGATE_FROM_CORES} cores up, else colocated)",
    )
    p.add_argument("--workers", type=int, default=None, help="number of colocated workers (default 1)")
    p.add_argument(
        "--prefill-replicas", type=int, default=None, help="disaggregated mode: prefill workers (default 1)"
    )
    p.add_argument(
        "--decode-replicas", type=int, default=None, help="disaggregated mode: decode workers (default 1)"
    )
    p.add_argument(
        "--port",
        type=int,
        default=None,
        help="public HTTP port and base of the internal ones "
        "(default: server.port from the config, 8000); 0 takes free ports",
    )
    p.add_argument("--host", default=None, help="public HTTP host (default: server.host, 127.0.0.1)")
    p.add_argument("--config", default=None, help="kvrelay YAML config")
    p.add_argument("--model", default=None, help="model directory (default: model.path from the config)")
    p.add_argument(
        "--grace-seconds",
        type=float,
        default=DEFAULT_GRACE_S,
        help="how long children may take to stop before they are killed (default 30)",
    )
    p.add_argument("--grpc-port", type=int, default=None, help="serve the public gRPC API on this port")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    configure_logging("up")
    cores = available_cores()
    mode = resolve_mode(args.mode, cores)
    if mode != args.mode:
        log.info("--mode auto", extra={"mode": mode, "cores": cores})
    workers = plan_workers(mode, args.workers, args.prefill_replicas, args.decode_replicas)
    if args.grace_seconds < 0:
        raise UpError(f"--grace-seconds must be 0 or more, got {args.grace_seconds}")
    cfg = share_one_gpu(load_config(args.config), len(workers))
    model_dir = Path(args.model or cfg.model.path).resolve()
    if not model_dir.is_dir():
        raise ModelNotFoundError(
            f"model directory {model_dir} does not exist; run `kvrelay models prepare` or pass --model"
        )
    host = args.host or cfg.server.host
    base_port = cfg.server.port if args.port is None else args.port
    ports = derive_ports(base_port, len(workers), free_ports, tuple(w.name for w in workers))
    if args.port != 0:
        _check_ports_free(host, ports)
    password = os.environ.get(KV_TIERS_PASSWORD_ENV)
    with (
        local_cache_redis(cfg.kv_tiers.shared_url, password) as cache_port,
        local_queue_redis(cfg.queue.url, QUEUE_DATA_DIR) as queue_port,
        tempfile.TemporaryDirectory(prefix="kvrelay-up-") as tmp,
    ):
        if cache_port is not None:
            log.info("started the KV cache's redis-server", extra={"port": cache_port})
        if queue_port is not None:
            log.info(
                "started the queue's redis-server", extra={"port": queue_port, "dir": str(QUEUE_DATA_DIR)}
            )
        plan = StackPlan(
            host=host,
            ports=ports,
            config_path=write_stack_config(Path(tmp), cfg, model_dir, host, ports.codec),
            model_dir=model_dir,
            threads_per_worker=threads_per_worker(cores, len(workers)),
            env=child_env(os.environ, secrets.token_urlsafe(32)),
            grpc_port=args.grpc_port,
            mode=mode,
            worker_roles=tuple(w.role for w in workers),
            tls=cfg.internal_tls,
            drain=cfg.queue.url is not None,
        )
        return _supervise(plan, args.grace_seconds)


# What `kvrelay up`'s workers take of one GPU together when the config leaves each one's share unset.
SHARED_GPU_UTILIZATION = 0.9


def share_one_gpu(cfg: KvrelayConfig, num_workers: int) -> KvrelayConfig:
    """Every worker `kvrelay up` starts sees the same GPU: split SHARED_GPU_UTILIZATION evenly between
    them where `engine.gpu_memory_utilization` is unset, and refuse a set share that, taken by every
    worker, asks for more than 0.95 of the device (checked only where a CUDA device is visible)."""
    engine = cfg.engine
    if engine.device == "cpu" or num_workers < 2:
        return cfg
    if "gpu_memory_utilization" not in engine.model_fields_set:
        share = int(SHARED_GPU_UTILIZATION / num_workers * 100) / 100
        return cfg.model_copy(update={"engine": engine.model_copy(update={"gpu_memory_utilization": share})})
    from services.engine.loading.device import check_shared_device, resolve_device

    if resolve_device(engine.device).type == "cuda":
        shares = {f"worker-{i}": engine.gpu_memory_utilization for i in range(num_workers)}
        check_shared_device(shares, engine.device)
    return cfg


def _supervise(plan: StackPlan, grace_s: float) -> int:
    url = public_url(plan.host, plan.ports.codec)
    log.info(
        "starting the stack",
        extra={
            "mode": plan.mode,
            "url": url,
            "ports": dict(plan.ports.all()),
            "model": str(plan.model_dir),
            "num_workers": len(plan.ports.workers),
            "workers": {w.name: w.role for w in plan.workers()},
            "threads_per_worker": plan.threads_per_worker,
        },
    )
    log.warning("open mode: no API key is required; for local use only", extra={"auth": "open"})

    def announce() -> None:
        print(f"kvrelay ready on {url}", flush=True)

    supervisor = Supervisor(build_specs(plan), SupervisorOptions(grace_s=grace_s), on_ready=announce)
    return supervisor.run()


def _check_ports_free(host: str, ports: StackPorts) -> None:
    """Fail before starting anything if a port is taken (gRPC servers share ports with SO_REUSEPORT,
    so a clash would not even fail loudly)."""
    for name, port in ports.all():
        bind_host = host if name == "codec" else INTERNAL_HOST
        family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((bind_host, port))
            except OSError as exc:
                raise UpError(
                    f"port {port} ({name}) on {bind_host} is not free ({exc.strerror}); the stack uses "
                    f"ports {ports.codec}-{ports.codec + len(ports.workers) + 1}: pick another --port, "
                    "or --port 0 for free ones"
                ) from None
