"""gpu_check's stages across processes and the cancel storm: 9 ipc (a CUDA IPC transfer to a fresh
interpreter), 10 nccl (two ranks on one device) and 11 cancel. Stages 9 and 10 start their children with
`child_command`, which runs a function of this module by name in a fresh interpreter."""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_check_model import SHAPES, build_engine, build_hf, random_prompts, timed

# ------------------------------------------------------------------ stages 9 and 10: other processes

SCRIPTS_DIR = Path(__file__).resolve().parent
MODULE = Path(__file__).stem  # what the children import: gpu_check_transfer
CONSUMER_TIMEOUT_S = 120.0  # stage 9's child: a fresh interpreter's torch import and CUDA start, 6 copies
NCCL_TIMEOUT_S = 20.0  # stage 10: each rank's process-group timeout; a rank still running 5 s later is killed
COPY_REPS = 5


def child_command(function: str, *argv: str) -> list[str]:
    """A fresh interpreter (never a fork) that puts scripts/ on its sys.path, imports gpu_check (which puts
    the repository root there too) and exits with this module's `function(argv)`. It inherits the
    environment (PYTHONPATH and all)."""
    code = (
        f"import sys; sys.path.insert(0, {str(SCRIPTS_DIR)!r}); import gpu_check; import {MODULE}; "
        f"sys.exit({MODULE}.{function}(sys.argv[1:]))"
    )
    return [sys.executable, "-c", code, *argv]


def stage_ipc(args: argparse.Namespace) -> dict[str, Any]:
    """This process fills a buffer with random bytes, checksums it on its device and `share`s it; a fresh
    interpreter (`ipc_consumer`) gets the handle on stdin, opens it and copies it into its own buffer.
    Rates count bytes read plus written, as stage 1 does, so `share_of_copy` compares like with like."""
    import torch

    from services.kvtransfer.device_checksum import device_checksum
    from services.kvtransfer.ipc_transport import ipc_domain, share

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    num_bytes = args.ipc_mib * 2**20
    gen = torch.Generator(device=device).manual_seed(9)
    flat = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device=device, generator=gen)  # [num_bytes]
    checksum = device_checksum(flat)
    handle = share(flat)  # on a CPU this moves `flat` into shared memory
    domain = ipc_domain(device)
    copy = _rates(num_bytes, _copy_seconds(torch.empty_like(flat), flat))  # before the child: no contention
    started = time.perf_counter()
    # `flat` stays referenced until the consumer has exited: run() returns only then.
    child = subprocess.run(
        child_command("ipc_consumer", str(num_bytes), str(device)),
        input=handle.SerializeToString(), capture_output=True, timeout=CONSUMER_TIMEOUT_S,
    )  # fmt: skip
    report = _last_json(child.stdout.decode(errors="replace"))
    if child.returncode != 0 or report is None:
        raise RuntimeError(f"the consumer exited {child.returncode}: {child.stderr.decode()[-2000:]}")
    same_bytes, same_domain = report["checksum"] == checksum, report["domain"] == domain
    return {
        "ok": same_bytes and same_domain, "bytes": num_bytes, "handle": handle.WhichOneof("storage"),
        "checksum": f"{checksum:016x}", "consumer_checksum": f"{report['checksum']:016x}",
        "checksums_equal": same_bytes, "domain": domain, "consumer_domain": report["domain"],
        "domains_equal": same_domain, "consumer_device": report["device"], "pid": os.getpid(),
        "consumer_pid": report["pid"],
        "consumer_seconds": round(time.perf_counter() - started, 2), "reps": COPY_REPS,
        "ipc": {k: v for k, v in report.items() if k not in ("checksum", "domain", "device", "pid")},
        "copy": copy, "share_of_copy": round(report["gb_per_s"] / copy["gb_per_s"], 3),
        "share_of_copy_median": round(report["gb_per_s_median"] / copy["gb_per_s_median"], 3),
    }  # fmt: skip


def ipc_consumer(argv: list[str]) -> int:
    """Stage 9's other process (argv: num_bytes, device; the IpcSlice on stdin): opens the producer's
    buffer, copies it into its own, checksums the copy on the device, prints one JSON line."""
    import torch

    from services.kvtransfer.device_checksum import device_checksum
    from services.kvtransfer.ipc_transport import ipc_domain, open_shared
    from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb

    num_bytes, device = int(argv[0]), torch.device(argv[1])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    handle = kvpb.IpcSlice.FromString(sys.stdin.buffer.read())
    src = open_shared(handle, num_bytes, device)  # [num_bytes] uint8: the producer's memory, mapped here
    dst = torch.empty(num_bytes, dtype=torch.uint8, device=device)  # [num_bytes]
    seconds = _copy_seconds(dst, src)
    report = {"checksum": device_checksum(dst), "domain": ipc_domain(device), "device": str(device),
              "pid": os.getpid()}  # fmt: skip
    print(json.dumps({**report, **_rates(num_bytes, seconds)}), flush=True)
    del src, dst
    return 0


def _copy_seconds(dst: Any, src: Any) -> list[float]:
    """Seconds of each of COPY_REPS `dst.copy_(src)` after a warm-up copy: CUDA events on a GPU."""
    import torch

    dst.copy_(src)
    seconds = []
    for _ in range(COPY_REPS):
        if dst.device.type != "cuda":
            seconds.append(timed(str(dst.device), lambda: dst.copy_(src)))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1000)
    return seconds


def _rates(num_bytes: int, seconds: list[float]) -> dict[str, float]:
    """Best and median of a copy's times, and its GB/s counting bytes read plus written (as stage 1)."""
    best, median = min(seconds), sorted(seconds)[len(seconds) // 2]
    return {
        "best_s": round(best, 6), "median_s": round(median, 6),
        "gb_per_s": round(2 * num_bytes / best / 1e9, 1),
        "gb_per_s_median": round(2 * num_bytes / median / 1e9, 1),
    }  # fmt: skip


def _last_json(stdout: str) -> dict[str, Any] | None:
    """The child's report: its last stdout line, when that is a JSON object."""
    lines = stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None
    return report if isinstance(report, dict) else None


def stage_nccl(args: argparse.Namespace) -> dict[str, Any]:
    """Two ranks on one device, each a fresh interpreter (`nccl_rank`) over a file store: NCCL on cuda:0
    (which it refuses), gloo on a CPU. `ok` when both ranks reported within the bound, refused or not."""
    cuda = args.device.startswith("cuda")
    backend, device = ("nccl", "cuda:0") if cuda else ("gloo", "cpu")
    env = {**os.environ, "NCCL_DEBUG": os.environ.get("NCCL_DEBUG", "WARN")}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        procs = []
        for rank in range(2):
            with (folder / f"{rank}.out").open("wb") as out, (folder / f"{rank}.err").open("wb") as err:
                argv = child_command("nccl_rank", str(rank), backend, device, str(folder / "store"))
                procs.append(subprocess.Popen(argv, stdout=out, stderr=err, env=env))
        killed = _join(procs, NCCL_TIMEOUT_S + 5)
        ranks = [
            {"rank": rank, "reported": False, **(_last_json((folder / f"{rank}.out").read_text()) or {}),
             "returncode": proc.returncode, "killed": killed[rank],
             "stderr_tail": (folder / f"{rank}.err").read_text(errors="replace")[-1200:]}
            for rank, proc in enumerate(procs)
        ]  # fmt: skip
    said = " ".join(" ".join(r.get("message", [])) + r["stderr_tail"] for r in ranks)
    return {
        "ok": all(r["reported"] for r in ranks), "backend": backend, "device": device, "ranks": ranks,
        "all_succeeded": all(r.get("succeeded") for r in ranks),
        "refused": all(r.get("error_type") for r in ranks),
        "duplicate_gpu_detected": "Duplicate GPU detected" in said,
    }  # fmt: skip


def nccl_rank(argv: list[str]) -> int:
    """Stage 10's rank (argv: rank, backend, device, store path): joins a group of two and all-reduces a
    one; prints one JSON line with the result or the exception, then exits without tearing the group down
    (a refused NCCL communicator may hang there, and the report is out)."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, backend, device, store_path = int(argv[0]), argv[1], argv[2], argv[3]
    report: dict[str, Any] = {"reported": True}
    started = time.perf_counter()
    try:
        if device.startswith("cuda"):
            torch.cuda.set_device(device)
        store = dist.FileStore(store_path, 2)
        timeout = datetime.timedelta(seconds=NCCL_TIMEOUT_S)
        dist.init_process_group(backend, store=store, rank=rank, world_size=2, timeout=timeout)
        value = torch.ones(1, device=device)  # [1]
        dist.all_reduce(value)
        total = float(value.item())  # waits for the collective
        report.update(succeeded=total == 2.0, all_reduce=total)
    except Exception as exc:  # the refusal is what this stage records
        report.update(succeeded=False, error_type=type(exc).__name__, message=str(exc).splitlines()[:8])
    report["seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(report), flush=True)
    sys.stderr.flush()
    os._exit(0)


def _join(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[bool]:
    """Wait for every process until one deadline; kill those still running. Which were killed."""
    deadline = time.monotonic() + timeout_s
    killed = []
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            killed.append(False)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            killed.append(True)
    return killed


# ------------------------------------------------------------------ stage 11: a cancel storm

CANCEL_TOLERANCE_BYTES = 2048


def stage_cancel(args: argparse.Namespace) -> dict[str, Any]:
    """64 long requests (half greedy, half sampled) stepped 8 times, so some are in prefill, some decode
    and one step is in flight, then all aborted; stepped until idle. Every KV block must be free again
    (prefix caching is off here, so none stays cached) and, on a GPU, memory_allocated back to its level
    after a warm-up of the same 64 rows run to their end. Tolerance: the runner keeps its last launch's
    picks ([num_samples] int64) for the next step's placeholders, and the storm's last launch may hold
    another number of rows than the warm-up's; up to 256 rows that is one 512-byte allocator block either
    way, so the level is normally exact (`memory_exact`). The sampler keeps no per-batch caches."""
    import torch

    shape = args.check_shape
    cuda = args.device.startswith("cuda")
    gc.collect()
    torch.cuda.empty_cache() if cuda else None
    layers = min(4, SHAPES[shape]["num_hidden_layers"])
    hf = build_hf(shape, args.device, torch.bfloat16, num_hidden_layers=layers)
    core = build_engine(hf, args.device, "bfloat16", gpu_memory_utilization=0.3, kv_cache_memory_mb=16)
    prompts = random_prompts(64, 64, SHAPES[shape]["vocab_size"], 11)
    _submit(core, "warm", prompts, 4)
    _step_until_idle(core)
    warm = _allocated(cuda)
    ids = _submit(core, "storm", prompts, min(1024, SHAPES[shape]["max_position_embeddings"] - 64))
    for _ in range(8):
        core.step()
    live = core.stats()
    aborted = core.abort(ids)
    steps_to_idle = _step_until_idle(core)
    after = _allocated(cuda)
    blocks = core.pool.stats()
    try:
        core.check_invariants()
        invariants = None
    except RuntimeError as exc:
        invariants = str(exc)
    all_free = blocks.num_free == blocks.num_total and not core.has_work()
    memory_ok = warm is None or after is None or after - warm <= CANCEL_TOLERANCE_BYTES  # None: a CPU
    return {
        "ok": all_free and invariants is None and memory_ok, "all_blocks_free": all_free,
        "blocks": vars(blocks), "invariant_error": invariants, "running_at_abort": live.num_running,
        "waiting_at_abort": live.num_waiting, "aborted_sequences": aborted, "steps_to_idle": steps_to_idle,
        "memory_allocated_after_warm_up": warm, "memory_allocated_after_cancel": after,
        "memory_exact": warm == after, "tolerance_bytes": CANCEL_TOLERANCE_BYTES, "overlap": core.overlap,
        "graphs": core.runner.graphs is not None,
    }  # fmt: skip


def _submit(core: Any, prefix: str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    """One request per prompt, even ones greedy and odd ones sampled; their ids."""
    from services.common.sampling import SamplingParams

    ids = []
    for i, prompt in enumerate(prompts):
        temperature = 0.0 if i % 2 == 0 else 0.8
        params = SamplingParams(temperature=temperature, top_p=0.9, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(f"{prefix}{i}", prompt, params)
        ids.append(f"{prefix}{i}")
    return ids


def _step_until_idle(core: Any, max_steps: int = 256) -> int:
    """Step until the core has no work (at most `max_steps`); how many steps that took."""
    steps = 0
    while core.has_work() and steps < max_steps:
        core.step()
        steps += 1
    return steps


def _allocated(cuda: bool) -> int | None:
    """torch.cuda.memory_allocated once the device is idle and garbage collected; None on a CPU."""
    import torch

    if not cuda:
        return None
    torch.cuda.synchronize()
    gc.collect()
    return int(torch.cuda.memory_allocated())


TIER_SEGMENT = 64
TIER_SEGMENTS = 4


def stage_tiers(args: argparse.Namespace) -> dict[str, Any]:
    """The host tier below the device pool (services/kvcache/host_tier.py): a prompt of four 64-token
    segments and one more token, answered greedily in fp32 (TF32 off), its segments written through from
    the pool to host memory; the pool emptied; the same prompt again, its KV fetched from the host tier and
    placed into fresh device blocks. The tokens must equal the cold answer's, with all four segments loaded
    (256 cached tokens). Reports the write-through and fetch rates (host tier bytes over their times)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    shape = args.check_shape
    cuda = args.device.startswith("cuda")
    gc.collect()
    torch.cuda.empty_cache() if cuda else None
    layers = min(4, SHAPES[shape]["num_hidden_layers"])
    hf = build_hf(shape, args.device, torch.float32, num_hidden_layers=layers, initializer_range=0.2)
    tiers = {"host_capacity_mb": 1024, "segment_tokens": TIER_SEGMENT, "fetch_deadline_ms": 30_000}
    core = build_engine(hf, args.device, "float32", kv_tiers=tiers, enable_prefix_caching=True,
                        gpu_memory_utilization=0.3, kv_cache_memory_mb=64)  # fmt: skip
    (prompt,) = random_prompts(1, TIER_SEGMENT * TIER_SEGMENTS + 1, SHAPES[shape]["vocab_size"], 12)
    started = time.perf_counter()
    cold, cold_cached = _answer(core, "cold", prompt)
    written = core.tiers.writes.writer.wait_idle(30)
    write_s = time.perf_counter() - started
    emptied = core.reset_prefix_cache()
    started = time.perf_counter()
    warm, warm_cached = _answer(core, "warm", prompt)
    warm_s = time.perf_counter() - started
    report = core.tiers.report()
    stats, (host,) = report.stats, report.tiers
    fetch_s = stats.fetch_seconds_sum.get("host", 0.0)
    expected = TIER_SEGMENT * TIER_SEGMENTS
    core.close()
    return {
        "ok": written and emptied and warm == cold and warm_cached == expected and cold_cached == 0,
        "tokens_equal": warm == cold, "cold_cached_tokens": cold_cached, "warm_cached_tokens": warm_cached,
        "fetched_tokens": stats.fetched_tokens, "host_bytes": host.used_bytes,
        "hits": stats.hits.get("host", 0), "fetch_s": fetch_s,
        "fetch_gb_per_s": stats.bytes_read.get("host", 0) / fetch_s / 1e9 if fetch_s else None,
        "cold_with_write_through_s": write_s, "warm_s": warm_s,
    }  # fmt: skip


def _answer(core: Any, request_id: str, prompt: list[int]) -> tuple[list[int], int]:
    """16 greedy tokens for `prompt`, and the prompt tokens the engine did not compute."""
    from services.common.sampling import SamplingParams

    core.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    tokens, cached = [], -1
    while core.has_work():
        for output in core.step():
            tokens += output.new_token_ids
            cached = output.num_cached_tokens
    return tokens, cached
