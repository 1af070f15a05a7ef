"""The client side of `kvrelay bench transfer`: streamed Generate calls through a router, timed here.

Each request gets a fresh prompt of random token IDs (its own seed), so neither the prefill nor the decode
replica's prefix cache can hit and every prompt token's KV really travels. Token arrival times are taken
on receipt of each GenerateResponse (several tokens in one response share its arrival time).

An encoder-decoder model (the stack's Info says so) gets the random prompt as its encoder input and the
decoder's start token as its prompt: what travels is then the encoder output (and one token's decoder
KV), and each Timing also says what the source's cross-attention KV would have weighed
(`cross_kv_bytes`: source tokens x the model's KV bytes per token, every decoder layer).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

import grpc

from services.bench.stats import median, percentile_or_nan
from services.bench.transfer.stack import GRPC_OPTIONS
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc

REQUEST_TIMEOUT_S = 600.0
Metadata = tuple[tuple[str, str], ...]


@dataclass
class Timing:
    """One request, seen by the client. Times are seconds from sending the request."""

    prompt_tokens: int
    tokens: int
    ttft_s: float
    t2_s: float  # time to the second token (nan with fewer than two)
    itl_s: float  # mean gap between tokens after the second (nan with fewer than three)
    end_s: float
    prefill_mode: str
    kv_bytes: int
    kv_seconds: float
    cached_tokens: int
    cross_kv_bytes: int = 0  # encoder-decoder: the cross KV the shipped encoder output stands for


def random_prompt(seed: int, length: int, vocab: int) -> list[int]:
    """Random IDs above the lowest eighth of the vocabulary (where the special tokens live)."""
    rng = random.Random(seed)
    low = max(2, vocab // 8)
    return [rng.randrange(low, vocab) for _ in range(length)]


class Client:
    def __init__(self, address: str, metadata: Metadata) -> None:
        self.channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.metadata = metadata
        self.info: pb.InfoResponse | None = None  # the model behind the router, asked once

    async def close(self) -> None:
        await self.channel.close()

    async def generate(self, request_id: str, prompt: list[int], new_tokens: int) -> Timing:
        sampling = sampling_to_proto(SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))
        if self.info is None:
            self.info = await self.stub.Info(pb.InfoRequest(), metadata=self.metadata, timeout=30)
        info = self.info
        request = pb.GenerateRequest(request_id=request_id, prompt_token_ids=prompt, sampling=sampling)
        if info.encoder_decoder:  # the prompt is the source; the decoder starts at its start token
            request.encoder_token_ids[:] = prompt
            request.prompt_token_ids[:] = [info.decoder_start_token_id]
        stamps: list[float] = []
        last = pb.GenerateResponse()
        t0 = time.perf_counter()
        call = self.stub.Generate(request, metadata=self.metadata, timeout=REQUEST_TIMEOUT_S)
        async for response in call:
            now = time.perf_counter() - t0
            stamps.extend([now] * len(response.token_ids))
            last = response
        cross_kv_bytes = len(prompt) * info.kv_bytes_per_token if info.encoder_decoder else 0
        return _timing(len(prompt), stamps, last, cross_kv_bytes)


def _timing(
    prompt_tokens: int, stamps: list[float], last: pb.GenerateResponse, cross_kv_bytes: int = 0
) -> Timing:
    nan = float("nan")
    return Timing(
        prompt_tokens=prompt_tokens,
        tokens=len(stamps),
        ttft_s=stamps[0] if stamps else nan,
        t2_s=stamps[1] if len(stamps) > 1 else nan,
        itl_s=(stamps[-1] - stamps[1]) / (len(stamps) - 2) if len(stamps) > 2 else nan,
        end_s=stamps[-1] if stamps else nan,
        prefill_mode=pb.PrefillMode.Name(last.prefill_mode).removeprefix("PREFILL_MODE_"),
        kv_bytes=int(last.kv_transfer_bytes),
        kv_seconds=float(last.kv_transfer_seconds),
        cached_tokens=int(last.num_cached_tokens),
        cross_kv_bytes=cross_kv_bytes,
    )


async def transfer_runs(
    address: str, metadata: Metadata, lengths: list[int], repeats: int, new_tokens: int, vocab: int,
    seed: int,
) -> dict[int, list[Timing]]:  # fmt: skip
    """`repeats` requests per prompt length, one at a time, after one uncounted warm-up request."""
    client = Client(address, metadata)
    try:
        await client.generate(f"warm-{seed}", random_prompt(seed, min(lengths), vocab), new_tokens)
        runs: dict[int, list[Timing]] = {}
        for length in lengths:
            runs[length] = []
            for i in range(repeats):
                request_seed = seed * 1_000_003 + length * 1009 + i + 1
                prompt = random_prompt(request_seed, length, vocab)
                runs[length].append(await client.generate(f"xfer-{request_seed}", prompt, new_tokens))
        return runs
    finally:
        await client.close()


def summarize_transfer(runs: list[Timing]) -> dict[str, Any]:
    """Medians over the runs of one prompt length, the two shares computed per run first."""

    def med(key: str) -> float:
        return median([float(getattr(r, key)) for r in runs])

    def share(denominator: str) -> float:
        return median([r.kv_seconds / getattr(r, denominator) for r in runs if getattr(r, denominator) > 0])

    cross = {}
    if any(r.cross_kv_bytes for r in runs):  # encoder-decoder: the shipped output against the cross KV
        cross = {
            "cross_kv_bytes": med("cross_kv_bytes"),
            "cross_kv_bytes_over_shipped": median(
                [r.cross_kv_bytes / r.kv_bytes for r in runs if r.kv_bytes]
            ),
        }
    return {
        **cross,
        "kv_bytes": med("kv_bytes"),
        "kv_bytes_per_token": median([r.kv_bytes / r.prompt_tokens for r in runs]),
        "kv_transfer_s": med("kv_seconds"),
        "ttft_s": med("ttft_s"),
        "time_to_second_token_s": med("t2_s"),
        "gap_first_to_second_s": median([r.t2_s - r.ttft_s for r in runs]),
        "inter_token_s": med("itl_s"),
        "transfer_share_of_second_token": share("t2_s"),
        "transfer_share_of_ttft": share("ttft_s"),
        "prefill_modes": sorted({r.prefill_mode for r in runs}),
        "runs": [asdict(r) for r in runs],
    }


@dataclass(frozen=True)
class LoadPlan:
    """Short requests sent every `short_interval_s` (open loop) for `seconds`, while `long_concurrency`
    closed loops each send a long prompt as soon as their previous one finished."""

    seconds: float
    short_tokens: int
    short_new_tokens: int
    short_interval_s: float
    long_tokens: int
    long_new_tokens: int
    long_concurrency: int


async def load_run(address: str, metadata: Metadata, plan: LoadPlan, vocab: int, seed: int) -> dict[str, Any]:
    client = Client(address, metadata)
    errors: list[str] = []
    try:
        await client.generate(f"warm-load-{seed}", random_prompt(seed, plan.short_tokens, vocab), 2)
        stop_at = time.perf_counter() + plan.seconds
        longs = [
            asyncio.create_task(_long_loop(client, plan, vocab, seed * 7919 + k * 100_003, stop_at, errors))
            for k in range(plan.long_concurrency)
        ]
        await asyncio.sleep(min(0.5, plan.seconds / 4))  # the first long prompts are in before any short
        shorts = await _short_stream(client, plan, vocab, seed * 104_729, stop_at, errors)
        long_timings = [t for task in longs for t in await task]
    finally:
        await client.close()
    return {"short": _load_summary(shorts), "long": _load_summary(long_timings), "errors": errors}


async def _guarded(client: Client, request_id: str, prompt: list[int], new_tokens: int, errors: list[str]
                   ) -> Timing | None:  # fmt: skip
    try:
        return await client.generate(request_id, prompt, new_tokens)
    except grpc.aio.AioRpcError as exc:
        errors.append(f"{request_id}: {exc.code().name} {exc.details()}")
        return None


async def _long_loop(client: Client, plan: LoadPlan, vocab: int, seed: int, stop_at: float,
                     errors: list[str]) -> list[Timing]:  # fmt: skip
    out: list[Timing] = []
    i = 0
    while time.perf_counter() < stop_at:
        prompt = random_prompt(seed + i, plan.long_tokens, vocab)
        timing = await _guarded(client, f"long-{seed + i}", prompt, plan.long_new_tokens, errors)
        if timing is not None:
            out.append(timing)
        i += 1
    return out


async def _short_stream(client: Client, plan: LoadPlan, vocab: int, seed: int, stop_at: float,
                        errors: list[str]) -> list[Timing]:  # fmt: skip
    tasks: list[asyncio.Task[Timing | None]] = []
    next_at = time.perf_counter()
    while next_at < stop_at:
        request_seed = seed + len(tasks)
        prompt = random_prompt(request_seed, plan.short_tokens, vocab)
        call = _guarded(client, f"short-{request_seed}", prompt, plan.short_new_tokens, errors)
        tasks.append(asyncio.create_task(call))
        next_at += plan.short_interval_s
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
    return [t for t in await asyncio.gather(*tasks) if t is not None]


def _load_summary(timings: list[Timing]) -> dict[str, Any]:
    ttft = [t.ttft_s for t in timings]
    modes: dict[str, int] = {}
    for t in timings:
        modes[t.prefill_mode] = modes.get(t.prefill_mode, 0) + 1
    return {
        "count": len(timings),
        "ttft_p50_s": percentile_or_nan(ttft, 50),
        "ttft_p99_s": percentile_or_nan(ttft, 99),
        "ttft_max_s": max(ttft) if ttft else float("nan"),
        "inter_token_p50_s": median([t.itl_s for t in timings]),
        "prefill_modes": modes,
    }
