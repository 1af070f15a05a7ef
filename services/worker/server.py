"""`kvrelay worker`: a gRPC worker process over one engine, in one of three roles:

- colocated: prefill and decode together (also pulls remote KV when a request names a prefill replica);
- decode: the same Worker API; the router names a prefill replica per request (services/decode/
  remote_prefill.py);
- prefill: also serves the Prefill RPC (services/prefill/prefill_service.py) that ships KV to decode.

Health (grpc.health.v1, no token needed): the service "" is SERVING once the model is loaded and warmed
up; "kvrelay.liveness" turns NOT_SERVING when the engine loop stops stepping while work waits.
On SIGTERM the worker reports NOT_SERVING, takes no new calls, lets in-flight calls finish within the
grace period, and exits.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import tracing
from services.common.config import DisaggregationConfig, KvrelayConfig, encoder_timeout_problem
from services.common.errors import ConfigError
from services.common.grpc_auth import InternalTokenInterceptor, TokenSource
from services.common.grpc_server import drain, stop_on_signals
from services.common.grpc_tls import add_port, server_options
from services.common.sampling import SamplingParams
from services.decode.remote_prefill import RemotePrefill
from services.engine.async_engine import AsyncEngine
from services.engine.core import EngineCore
from services.engine.kv_export import dtype_name
from services.engine.loading.device import CudaMemoryProbe
from services.engine.loading.factory import build_core
from services.kvtransfer.chunks import Layout
from services.kvtransfer.ipc_transport import IpcReceiver, IpcSender, ipc_domain
from services.kvtransfer.transport import GrpcReceiver, GrpcSender, KVReceiver, KVSender
from services.prefill.prefill_service import PrefillService
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2_grpc, worker_pb2_grpc
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.worker.counters import TransferCounters
from services.worker.metrics import WorkerMetrics
from services.worker.worker_service import WorkerService

log = logging.getLogger(__name__)

LIVENESS_SERVICE = "kvrelay.liveness"
STALL_SECONDS = 30.0  # no step for this long while work waits: the engine loop is stuck
WARMUP_REQUEST_ID = "warmup"


@dataclass(frozen=True)
class WorkerOptions:
    host: str
    port: int
    role: str
    name: str
    grace_seconds: float = 30.0
    metrics_port: int | None = None  # Prometheus /metrics over HTTP on the worker's host; off when None


def build_info(core: EngineCore, config: KvrelayConfig, role: str, name: str = "") -> pb.InfoResponse:
    cfg = core.model_config
    return pb.InfoResponse(
        model_name=config.model.served_name or Path(config.model.path).name,
        max_model_len=core.max_model_len,
        block_size=core.block_size,
        model_fingerprint=core.manifest.model_fingerprint,
        directory_fingerprint=core.manifest.directory_fingerprint,
        tokenizer_fingerprint=core.manifest.tokenizer_fingerprint,
        vocab_size=core.model_config.vocab_size,
        role=role,
        name=name,
        dtype=dtype_name(core.weight_dtype),
        weights=core.served.weights,
        small_step_max_tokens=core.served.small_step_max_tokens or 0,
        small_step_source=core.served.small_step_source,
        weight_bytes=core.served.weight_bytes,
        numerics=core.served.numerics,
        encoder_decoder=core.model_config.is_encoder_decoder,
        decoder_start_token_id=(cfg.bos_token_id or 0) if cfg.is_encoder_decoder else 0,
        encoder_bytes_per_token=cfg.hidden_size * core.weight_dtype.itemsize if cfg.is_encoder_decoder else 0,
    )


async def warm_up(engine: AsyncEngine, in_flight: set[str]) -> None:
    """One short generation, so the first real request does not pay for lazy initialisation. Its ID is
    held in `in_flight` meanwhile: the server already listens."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    cfg = engine.core.model_config
    prompt, source = list(range(1, 17)), []
    if cfg.is_encoder_decoder:  # the encoder reads the tokens, the decoder starts at its start token
        prompt, source = [cfg.bos_token_id or 0], prompt
    in_flight.add(WARMUP_REQUEST_ID)
    try:
        async for _ in engine.generate(WARMUP_REQUEST_ID, prompt, params, encoder_token_ids=source):
            pass
    finally:
        in_flight.discard(WARMUP_REQUEST_ID)


def _keep_torch_single_threaded_here() -> None:
    """This thread's torch work (KV chunks in and out) runs no OpenMP region, so the worker keeps the one
    libgomp pool of its engine thread (AsyncEngine.launch explains why a second pool slows every step).
    torch's thread count is per thread under OpenMP: the engine thread keeps its own."""
    torch.set_num_threads(1)


def kv_layout(core: EngineCore) -> Layout:
    cfg = core.model_config
    dtype = core.kv_dtype
    return Layout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, core.block_size, core.device.type)


def _transports(
    config: DisaggregationConfig, device: torch.device
) -> tuple[dict[str, KVSender], dict[str, KVReceiver]]:
    """Every transport this worker offers, its receivers on the KV cache's device (NCCL for torch and a
    device-to-device copy for ipc when that is a GPU)."""
    timeout_s = config.transfer_timeout_ms / 1000
    ipc = IpcSender(device, hold_s=timeout_s, expected=config.transport == "ipc")
    senders: dict[str, KVSender] = {"grpc": GrpcSender(), "ipc": ipc}
    receivers: dict[str, KVReceiver] = {"grpc": GrpcReceiver(), "ipc": IpcReceiver(device)}
    try:
        from services.kvtransfer.torch_transport import TorchReceiver, TorchSender
    except ImportError:  # torch.distributed is missing from this torch build
        return senders, receivers
    senders["torch"] = TorchSender(timeout_s=timeout_s)
    receivers["torch"] = TorchReceiver(timeout_s=timeout_s, device=device)
    return senders, receivers


async def serve(config: KvrelayConfig, options: WorkerOptions) -> None:
    # Spans go out as `<prefix>-<role>` (kvrelay-prefill, kvrelay-decode, kvrelay-colocated).
    tracing.setup_tracing(config.tracing, options.role, instance=options.name)
    try:
        await _serve(config, options)
    finally:
        tracing.shutdown_tracing()  # export the spans still buffered


async def _serve(config: KvrelayConfig, options: WorkerOptions) -> None:
    tokens = TokenSource.from_env()
    metrics = WorkerMetrics(options.role, options.name)
    engine = AsyncEngine.launch(lambda: build_core(config), metrics)
    core = engine.core
    problem = encoder_timeout_problem(config.limits) if core.model_config.is_encoder_decoder else None
    if problem is not None:  # known only now: the model says it is an encoder-decoder
        engine.shutdown()
        raise ConfigError(f"invalid configuration for {core.model_config.architecture}: {problem}")
    _keep_torch_single_threaded_here()
    info = build_info(core, config, options.role, options.name)
    counters = TransferCounters()
    metrics.watch(engine, counters, weight_bytes=core.served.weight_bytes)
    layout = kv_layout(core)
    if core.device.type == "cuda":
        bytes_per_block = layout.bytes_per_token * core.block_size
        metrics.watch_device(
            CudaMemoryProbe(core.device), lambda: engine.stats().kv_blocks.num_total * bytes_per_block
        )
    if options.metrics_port is not None:
        metrics.serve(options.host, options.metrics_port)
    senders, receivers = _transports(config.disaggregation, core.device)
    info.kv_bytes_per_token = layout.bytes_per_token
    info.ipc_domain = ipc_domain(core.device)
    remote = None
    if options.role != "prefill":
        timeout_s = config.disaggregation.transfer_timeout_ms / 1000
        fingerprint, tls = info.model_fingerprint, config.internal_tls
        cfg = core.model_config
        width = cfg.hidden_size if cfg.is_encoder_decoder else 0  # the encoder output P ships with the KV
        remote = RemotePrefill(
            engine, fingerprint, layout, tokens, counters, timeout_s, receivers, tls, encoder_width=width
        )
    # The grammar compiler (~0.4 s for a 49k vocabulary) before serving, not on the first grammar request.
    unavailable = await asyncio.to_thread(core.prepare_grammars)
    if unavailable is not None:
        log.warning(
            "structured output unavailable; grammar requests are refused", extra={"reason": unavailable}
        )
    in_flight: set[str] = set()  # request IDs the engine runs now, across the Worker and Prefill services
    service = WorkerService(engine, info, counters, remote, in_flight, config.engine.max_waiting_requests)
    health_servicer = health.aio.HealthServicer()
    server = grpc.aio.server(interceptors=[InternalTokenInterceptor(tokens)], options=server_options())
    worker_pb2_grpc.add_WorkerServicer_to_server(service, server)
    if options.role == "prefill":
        prefill = PrefillService(engine, info.model_fingerprint, layout, counters, senders, in_flight)
        kv_transfer_pb2_grpc.add_PrefillServicer_to_server(prefill, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{options.host}:{options.port}"
    add_port(server, address, config.internal_tls)
    await server.start()
    await health_servicer.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
    await warm_up(engine, in_flight)
    service.ready = True
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("worker ready", extra={"address": address, "role": options.role, "worker": options.name})
    stop = stop_on_signals()
    watchdog = asyncio.create_task(_watch(engine, health_servicer, stop))
    await stop.wait()
    log.info("worker draining", extra={"grace_seconds": options.grace_seconds})
    service.ready = False
    await drain(server, health_servicer, options.grace_seconds)
    watchdog.cancel()
    if remote is not None:
        await remote.close()
    engine.shutdown()


async def _watch(
    engine: AsyncEngine, health_servicer: health.aio.HealthServicer, stop: asyncio.Event
) -> None:
    serving = True
    while not stop.is_set():
        await asyncio.sleep(1.0)
        stats = engine.stats()
        has_work = stats.num_running + stats.num_waiting > 0
        stalled = has_work and time.monotonic() - engine.last_step_time > STALL_SECONDS
        alive = engine.is_alive and not stalled
        if alive != serving:
            serving = alive
            status = (
                health_pb2.HealthCheckResponse.SERVING
                if alive
                else health_pb2.HealthCheckResponse.NOT_SERVING
            )
            await health_servicer.set(LIVENESS_SERVICE, status)
            await health_servicer.set("", status)
            log.error("engine loop stalled") if not alive else log.info("engine loop recovered")
