"""`kvrelay bench stack`: concurrent streams through a running stack, next to the engine alone and
transformers' bf16 batch `generate`, in one run.

1. C concurrent streaming chat requests (ignore_eos, N tokens each) against `--url`. Aggregate decode
   tok/s counts the tokens that arrive after every stream has its first token, over that window.
   `--peer-url` streams the same requests to another server (llama.cpp's `llama-server`) in each round.
2. Our engine in this process at concurrency C (as `kvrelay bench engine` measures it).
3. transformers' bf16 `generate` at batch C (the same baseline as `kvrelay bench engine`).
The sides run one after another, so none competes with another for the CPU; the stack and the engine
alternate for `--rounds` rounds and the medians are compared, because a shared VM's speed drifts by 10-20%
within minutes and one pass of each would compare two different machines. The client shares the
machine with the stack, so it is kept light: aiohttp and a byte-level look at each event (httpx's line
iterator cost about a third of the codec's CPU per token). aiohttp comes with the `bench` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from services.bench.engine import QUESTIONS, build_engine, chat_prompts, measure_baseline, run_batch
from services.bench.plots import plot_stack
from services.bench.rounds import ratio_range
from services.bench.stats import median_row

LOOPBACK = ("http://127.", "http://localhost", "http://[::1]")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stack", help="concurrent streams through a running stack vs engine vs transformers")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="models/smollm2-135m-instruct", help="for the in-process sides")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3, help="stack/engine pairs; medians are reported")
    p.add_argument(
        "--peer-url",
        default=None,
        help="another OpenAI-compatible server on loopback (llama.cpp's llama-server), streamed to the same "
        "way in each round, after the stack and the engine",
    )
    p.add_argument("--peer-name", default="llama-server", help="what to call the peer in the output")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="write a PNG chart here")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    for url in (args.url, args.peer_url or args.url):
        if not url.startswith(LOOPBACK):
            raise SystemExit("kvrelay bench stack only targets loopback URLs")
    result: dict[str, Any] = {"concurrency": args.concurrency, "new_tokens": args.new_tokens}
    result.update(_measure_in_process(args))
    _print(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot_stack(result, args.plot)
    return 0


async def _measure_stack(url: str, concurrency: int, new_tokens: int) -> dict[str, float]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=600)
    # a connection per request: llama-server closes a streamed response's connection, which a pool would reuse
    connector = aiohttp.TCPConnector(limit=concurrency + 1, force_close=True)
    async with aiohttp.ClientSession(url, timeout=timeout, connector=connector) as client:
        async with client.get("/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        await _stream(client, model, QUESTIONS[0], 4)  # warm-up
        t0 = time.perf_counter()
        runs = await asyncio.gather(
            *(_stream(client, model, QUESTIONS[i % len(QUESTIONS)], new_tokens) for i in range(concurrency))
        )
    t_all_first = max(r[0] for r in runs)
    end = max(r[-1] for r in runs)
    after = sum(1 for r in runs for t in r if t > t_all_first)
    return {
        "decode_tok_s": after / (end - t_all_first),
        "e2e_tok_s": sum(len(r) for r in runs) / (end - t0),
        "ttft_ms_max": 1000 * (t_all_first - t0),
        "num_tokens": sum(len(r) for r in runs),
    }


async def _stream(client: Any, model: str, question: str, new_tokens: int) -> list[float]:
    """Arrival time of each token-bearing chunk (one token per chunk at most, so this counts tokens)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stamps: list[float] = []
    async with client.post("/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:  # one SSE line at a time
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if b'"content":"' in line and b'"content":""' not in line:
                stamps.append(now)
            elif b'"usage":{' in line:
                chunk = json.loads(line[6:])
                if "choices" not in chunk:
                    raise RuntimeError(f"the stream failed: {chunk}")
                missing = chunk["usage"]["completion_tokens"] - len(stamps)
                stamps.extend([now] * max(0, missing))  # tokens held back then flushed together
            elif b'"error"' in line:
                raise RuntimeError(f"the stream failed: {line[6:].decode()}")
    return stamps


def _measure_in_process(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    side_args = argparse.Namespace(
        model=args.model,
        dtype=args.dtype,
        new_tokens=args.new_tokens,
        prefill_tokens=16,
        threads=args.threads,
    )
    prompts = chat_prompts(Path(args.model), args.concurrency)
    prefill = [list(range(100, 116))] * 2
    engine = build_engine(side_args, args.concurrency)
    stack_rounds: list[dict[str, float]] = []
    engine_rounds: list[dict[str, float]] = []
    peer_rounds: list[dict[str, float]] = []
    for i in range(max(1, args.rounds)):
        stack_rounds.append(asyncio.run(_measure_stack(args.url, args.concurrency, args.new_tokens)))
        engine_rounds.append(run_batch(engine, prompts, args.new_tokens, f"round{i}"))
        if args.peer_url:
            peer_rounds.append(asyncio.run(_measure_stack(args.peer_url, args.concurrency, args.new_tokens)))
    del engine
    c = str(args.concurrency)
    out: dict[str, Any] = {
        "stack": {**median_row(stack_rounds, "decode_tok_s"), "rounds": stack_rounds},
        "engine": {"decode": {c: median_row(engine_rounds, "tok_s")}, "rounds": engine_rounds},
    }
    if peer_rounds:
        out["peer"] = {
            "name": args.peer_name,
            **median_row(peer_rounds, "decode_tok_s"),
            "rounds": peer_rounds,
        }
    if not args.no_baseline:
        out["transformers"] = measure_baseline(side_args, prompts, prefill, [args.concurrency])
    return out


def _print(result: dict[str, Any]) -> None:
    c = str(result["concurrency"])
    stack = result["stack"]["decode_tok_s"]
    engine = result["engine"]["decode"][c]["tok_s"]
    rounds = len(result["stack"]["rounds"])
    print(f"concurrency {c}, {result['new_tokens']} tokens per stream, medians of {rounds} rounds")
    print(f"stack decode tok/s        {stack:8.1f}   (e2e {result['stack']['e2e_tok_s']:.1f})")
    stack_rates = [r["decode_tok_s"] for r in result["stack"]["rounds"]]
    engine_rates = [r["tok_s"] for r in result["engine"]["rounds"]]
    spread = ratio_range(stack_rates, engine_rates, ".2f")
    print(f"engine decode tok/s       {engine:8.1f}   stack/engine {stack / engine:.2f}{spread}")
    if "peer" in result:
        peer, name = result["peer"]["decode_tok_s"], result["peer"]["name"]
        peer_rates = [r["decode_tok_s"] for r in result["peer"]["rounds"]]
        spread = ratio_range(stack_rates, peer_rates, ".2f")
        print(f"{name + ' decode tok/s':<26}{peer:8.1f}   stack/{name} {stack / peer:.2f}{spread}")
    if "transformers" in result:
        base = result["transformers"]["decode"][c]["tok_s"]
        print(f"transformers bf16 tok/s   {base:8.1f}   stack/transformers {stack / base:.2f}")
