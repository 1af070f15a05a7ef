"""`kvrelay bench engine`: our engine against transformers' bf16 `generate`, same prompts, one run.

`--weights safetensors,gguf` measures our engine once per weights setting (model.weights: the float
safetensors, or the GGUF's blocks as stored), each a side of its own; `--kv-cache-dtype auto,float32`
crosses them with engine.kv_cache_dtype values (a side per pair), and `--numerics default,deterministic`
with engine.deterministic off and on (with --rounds, the default side over the deterministic one as
within-round ratios: the mode's cost at each batch size and in prefill). `--peer llama.cpp PATH` also runs
llama.cpp's `llama-bench` at PATH (scripts/build_llama_bench.sh builds it) on the same GGUF file: its
pp<prefill> and tg<new tokens> rates are the peer's prefill and batch-1 decode. The run also measures
this machine's read bandwidth (a sum over 1 GiB, median of 5) and from it the batch-1 decode bound of
each of our sides: bandwidth / the bytes of weights one decode step reads.

Decode rates leave prefill out on both sides: for transformers, a no-op logits processor stamps every
step and the rate is B·(steps−1)/(t_last − t_first); for our engine, the same count over the steps after
every sequence has its first token. `--depth N` puts N random tokens of context ahead of each decode
prompt (the peer's tg then runs at llama-bench's -d N), where attention's share of a step shows.
Prefill is one 512-token prompt (fresh random tokens each run, so no prefix-cache hit), median of 3
after a warm-up. TTFT is the median time to the first token.

`--rounds N` measures every one of our sides and the peer N times, taking turns (services/bench/rounds.py):
each side's numbers are then medians over its rounds, and the peer and bound lines add the range of the
ratios taken within each round, which a shared machine's drift does not skew. Every engine is built
before the first round; transformers, slow and not a ratio the issue pins, runs once after them.

The two sides (`measure_engine`, `measure_baseline`) and the engine helpers (`build_engine`,
`run_batch`, `chat_prompts`) also serve `kvrelay bench stack`. torch and transformers (the `worker`
extra) are imported only when a side runs.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any, get_args

from services.bench.plots import plot_engine
from services.bench.rounds import decode_rates, merge_rounds, ratio_range
from services.bench.stats import median
from services.bench.tables import format_table
from services.common.config import EngineConfig
from services.common.sampling import SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis in simple terms for a child who is ten years old.",
    "List three uses of Python.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes with all the steps and ingredients.",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes fly?",
]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("engine", help="engine decode/prefill throughput against transformers generate")
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    p.add_argument("--concurrency", default="1,8,32", help="comma-separated batch sizes")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument(
        "--depth",
        type=_non_negative,
        default=0,
        help="tokens of context before decode: random tokens ahead of each chat prompt (llama-bench -d)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--rounds",
        type=_positive,
        default=1,
        help="measure our sides and the peer this many times, taking turns; report medians and the "
        "per-round ratios (llama-bench then runs -r 1 a round)",
    )
    p.add_argument("--no-baseline", action="store_true", help="skip transformers (not a comparison)")
    p.add_argument(
        "--weights",
        default="auto",
        help="comma-separated model.weights values, one side each (auto, safetensors, gguf, gguf-int8, "
        "gguf-hybrid)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="comma-separated engine.kv_cache_dtype values (auto, float32, float16), crossed with --weights",
    )
    p.add_argument(
        "--numerics",
        default="default",
        help="comma-separated numerics modes (default, deterministic: engine.deterministic), crossed with "
        "the others; with both, the deterministic side is measured against the default one in each round",
    )
    p.add_argument(
        "--peer", nargs=2, metavar=("NAME", "PATH"), default=None, help="llama.cpp PATH-to-llama-bench"
    )
    p.add_argument("--json", type=Path, default=None, help="write results as JSON here")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart here")
    p.set_defaults(handler=run)


def side_name(weights: str, kv: str, num_weights: int, num_kv: int, mode: str = "default") -> str:
    """kvrelay, kvrelay-<weights>, kvrelay-<weights>-kv-<dtype>: as many parts as the run varies;
    "-deterministic" after a side under engine.deterministic."""
    name = "kvrelay" if num_weights == 1 and num_kv == 1 else f"kvrelay-{weights}"
    name = name if num_kv == 1 else f"{name}-kv-{kv}"
    return f"{name}-deterministic" if mode == "deterministic" else name


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    import torch

    from services.engine.loading.loader import resolve_precision

    torch.set_num_threads(args.threads)
    batches = [int(x) for x in args.concurrency.split(",")]
    rng = random.Random(0)
    prompts = at_depth(chat_prompts(Path(args.model), max(batches)), args.depth, rng)
    prefill_prompts = [[rng.randrange(100, 30000) for _ in range(args.prefill_tokens)] for _ in range(4)]
    result: dict[str, Any] = {
        "model": str(args.model),
        "dtype": args.dtype,
        "precision": resolve_precision(args.dtype).describe(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "baseline": "transformers generate, bfloat16, sdpa",
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "prefill_tokens": args.prefill_tokens,
        "depth": args.depth,
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    weights, kv_dtypes = args.weights.split(","), args.kv_cache_dtype.split(",")
    modes = args.numerics.split(",")
    if set(modes) - {"default", "deterministic"}:
        raise SystemExit(f"--numerics: {args.numerics} is not default, deterministic or both")
    choices = get_args(EngineConfig.model_fields["kv_cache_dtype"].annotation)  # the setting's own
    unknown = sorted(set(kv_dtypes) - set(choices))
    if unknown:  # before any side runs, not minutes in
        known = ", ".join(choices)
        raise SystemExit(f"--kv-cache-dtype: {', '.join(unknown)} not one of {known}")
    result.update(measure_in_rounds(args, prompts, prefill_prompts, batches, weights, kv_dtypes, modes))
    if not args.no_baseline:
        result["transformers"] = measure_baseline(args, prompts, prefill_prompts, batches)
        result["sides"].append("transformers")
    print_comparisons(result, batches)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot_engine(result, batches, args.plot)
    return 0


def measure_in_rounds(
    args: argparse.Namespace,
    prompts: list[list[int]],
    prefill_prompts: list[list[int]],
    batches: list[int],
    weights: list[str],
    kv_dtypes: list[str],
    modes: tuple[str, ...] | list[str] = ("default",),
) -> dict[str, Any]:
    """Every (weights, KV dtype) side of ours built first, then `args.rounds` rounds in which this machine's
    read bandwidth, each side in turn and the peer (if any) are measured: the result's sides (medians over
    rounds, services/bench/rounds.py), the bandwidth, and each side's bound from it."""
    engines = {
        side_name(choice, kv, len(weights), len(kv_dtypes), mode): (
            choice,
            build_engine(args, max(max(batches), 1), choice, kv, deterministic=mode == "deterministic"),
        )
        for choice, kv, mode in ((w, kv, m) for w in weights for kv in kv_dtypes for m in modes)
    }
    rounds: dict[str, list[dict[str, Any]]] = {side: [] for side in [*engines, "llama.cpp"]}
    bandwidths = []
    for _ in range(args.rounds):
        bandwidths.append(read_bandwidth_gb_s())
        for side, (_, engine) in engines.items():
            rounds[side].append(measure_engine(args, engine, prompts, prefill_prompts, batches))
        if args.peer is not None:
            repetitions = 3 if args.rounds == 1 else 1
            rounds["llama.cpp"].append(measure_llama_bench(args, Path(args.peer[1]), repetitions))
    out: dict[str, Any] = {"bandwidth_gb_s": median(bandwidths), "sides": list(engines)}
    if args.rounds > 1:
        out |= {"rounds": args.rounds, "bandwidth_rounds_gb_s": bandwidths}
    for side, (choice, engine) in engines.items():
        out[side] = {**merge_rounds(rounds[side]), **describe_engine(engine, choice)}
        out[side]["bound_tok_s"] = out["bandwidth_gb_s"] * 1e9 / out[side]["step_weight_bytes"]
    if args.peer is not None:
        out["llama.cpp"] = {**rounds["llama.cpp"][0], **merge_rounds(rounds["llama.cpp"])}
        out["sides"].append("llama.cpp")
    return out  # the engines and their KV caches go here, before transformers loads


def print_comparisons(result: dict[str, Any], batches: list[int]) -> None:
    """The table, each side's share of the bound, each side against llama.cpp, and any preemptions."""
    print(format_table(*table(result, batches)))
    for side in result["sides"]:
        if "bound_tok_s" in result[side]:
            bandwidths = result.get("bandwidth_rounds_gb_s")
            print(bound_line(side, result[side], batches[0], result["bandwidth_gb_s"], bandwidths))
    if "llama.cpp" in result:
        for side in result["sides"]:
            if side.startswith("kvrelay"):
                print(peer_line(side, result[side], result["llama.cpp"]))
    ours = [side for side in result["sides"] if side.startswith("kvrelay")]
    for other in ours[1:]:
        if len(result[ours[0]].get("rounds", [])) > 1:
            print(sides_line(ours[0], other, result, batches))
    for side in result["sides"]:
        for batch, rates in result[side].get("decode", {}).items():
            if rates.get("preemptions"):
                print(
                    f"{side} @{batch}: {rates['preemptions']} preemptions (KV cache full; raise "
                    "engine.kv_cache_memory_mb): its rates include recomputed prefills"
                )


def chat_prompts(model_dir: Path, count: int) -> list[list[int]]:
    """`count` chat prompts (QUESTIONS in turn) rendered and encoded with the model's own template."""
    from services.codec.text.chat_template import chat_template_from_tokenizer, render_and_encode
    from services.codec.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(model_dir)
    template = chat_template_from_tokenizer(tokenizer)
    return [
        render_and_encode(template, tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}])
        for i in range(count)
    ]


def table(result: dict[str, Any], batches: list[int]) -> tuple[list[str], list[list[str]]]:
    """Prefill tok/s, then decode tok/s and TTFT per batch size, per side, and the first side's ratio to
    the last (a side without a value, llama.cpp's batches above 1, shows "-")."""
    sides = result.get("sides") or [s for s in ("kvrelay", "transformers") if s in result]
    header = ["metric", *sides] + (["ratio"] if len(sides) >= 2 else [])
    metrics: list[tuple[str, list[float | None], str]] = [
        ("prefill tok/s", [result[s]["prefill_tok_s"] for s in sides], ".0f")
    ]
    for b in batches:
        metrics.append((f"decode tok/s @{b}", [_decode(result[s], b, "tok_s") for s in sides], ".1f"))
    for b in batches:
        metrics.append((f"TTFT ms @{b}", [_decode(result[s], b, "ttft_ms") for s in sides], ".0f"))
    rows = []
    for name, values, fmt in metrics:
        row = [name, *["-" if v is None else format(v, fmt) for v in values]]
        if len(sides) >= 2:  # from the measured values: a TTFT under 0.5 ms prints as 0
            ours, theirs = (values[0], values[-1]) if not name.startswith("TTFT") else (values[-1], values[0])
            row.append(f"{ours / theirs:.2f}x" if ours is not None and theirs else "n/a")
        rows.append(row)
    return header, rows


def bound_line(
    name: str, side: dict[str, Any], batch: int, bandwidth_gb_s: float, bandwidths: list[float] | None = None
) -> str:
    """How near the memory-bandwidth bound a side decodes at `batch`; with each round's read bandwidth
    (`bandwidths`), also the range of the shares taken round by round."""
    rate, bound = side["decode"][str(batch)]["tok_s"], side["bound_tok_s"]
    bounds = [gb_s * 1e9 / side["step_weight_bytes"] for gb_s in bandwidths or []]
    spread = ratio_range(decode_rates(side, batch), bounds, ".0%")
    weight_mb = side["step_weight_bytes"] / 1e6
    return (
        f"{name}: decode @{batch} {rate:.1f} tok/s = {rate / bound:.0%} of the bound {bound:.0f} tok/s "
        f"({bandwidth_gb_s:.1f} GB/s read, {weight_mb:.0f} MB of weights a step{spread})"
    )


def peer_line(name: str, side: dict[str, Any], peer: dict[str, Any]) -> str:
    """One of our sides against llama-bench on the same GGUF: its prefill and batch-1 decode rates over the
    peer's (the table's ratio column compares only the first side with the last), each with the range of
    the per-round ratios when the run took turns in rounds."""
    prefill = side["prefill_tok_s"] / peer["prefill_tok_s"]
    ours_prefill, peer_prefill = ([r["prefill_tok_s"] for r in s.get("rounds", [s])] for s in (side, peer))
    ours, theirs = _decode(side, 1, "tok_s"), _decode(peer, 1, "tok_s")
    shown = "n/a (no batch 1 measured)"
    if ours is not None and theirs:
        shown = f"{ours / theirs:.2f}x{ratio_range(decode_rates(side, 1), decode_rates(peer, 1), '.2f')}"
    prefill_spread = ratio_range(ours_prefill, peer_prefill, ".2f")
    return f"{name} / llama.cpp: prefill {prefill:.2f}x{prefill_spread}, decode @1 {shown}"


def sides_line(first: str, other: str, result: dict[str, Any], batches: list[int]) -> str:
    """The first of our sides against another, each metric as the median of the ratios taken within each
    round, with their range: the drift of a shared VM between rounds cancels out of each ratio."""
    rounds = {side: result[side]["rounds"] for side in (first, other)}
    metrics: list[tuple[str, Any]] = [("prefill", lambda r: r["prefill_tok_s"])]
    metrics += [(f"decode @{b}", lambda r, b=b: r["decode"][str(b)]["tok_s"]) for b in batches]
    parts = []
    for name, value in metrics:
        ratios = [value(a) / value(b) for a, b in zip(rounds[first], rounds[other], strict=True)]
        parts.append(f"{name} {median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")
    return f"{first} / {other}, medians of within-round ratios: " + ", ".join(parts)


def _decode(side: dict[str, Any], batch: int, key: str) -> float | None:
    value = side["decode"].get(str(batch), {}).get(key)
    return None if value is None else float(value)


def read_bandwidth_gb_s(num_bytes: int = 1 << 30) -> float:
    """This machine's memory read bandwidth now: a sum over `num_bytes` of fp32 (too big for any cache),
    median of 5 after a warm-up, on torch's threads."""
    import torch

    data = torch.ones(num_bytes // 4)  # [floats]
    times = []
    for _ in range(6):
        t0 = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - t0)
    return num_bytes / median(times[1:]) / 1e9


def run_llama_cpp(command: list[str], without_repack: list[str], timeout_s: float) -> tuple[str, list[str]]:
    """A llama.cpp tool's stdout, and the command that gave it. Where its default weight repacking kills it
    with a signal (its AMX path died with SIGSEGV on a Sapphire Rapids VM), it runs again with
    `without_repack` added, as a llama.cpp user there would. Any other failure raises with its stderr."""
    import subprocess

    def run(argv: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )

    done = run(command)
    if done.returncode < 0:  # killed by a signal
        command = [*command, *without_repack]
        done = run(command)
    if done.returncode != 0:
        raise RuntimeError(f"{Path(command[0]).name} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout, command


def at_depth(prompts: list[list[int]], depth: int, rng: random.Random) -> list[list[int]]:
    """Each prompt behind `depth` random tokens of its own (IDs in [100, 30000), as the prefill prompts)."""
    return [[rng.randrange(100, 30000) for _ in range(depth)] + prompt for prompt in prompts]


def measure_llama_bench(args: argparse.Namespace, llama_bench: Path, repetitions: int = 3) -> dict[str, Any]:
    """llama.cpp's llama-bench on the GGUF our model directory keeps (else the one it was made from):
    pp<prefill_tokens> and tg<new_tokens> (the latter after `args.depth` tokens of context, its -d; the
    former from an empty cache, as ours), `args.threads` threads, `repetitions` runs, its mean rates.
    Where its default weight repacking crashes it (its AMX path died with SIGSEGV on a Sapphire Rapids VM),
    it runs again with `--repack 0` (run_llama_cpp), and the result's command says so."""
    from services.common.manifest import GGUF_WEIGHTS_NAME
    from services.engine.loading.prepare import default_gguf_path

    gguf = Path(args.model) / GGUF_WEIGHTS_NAME
    gguf = gguf if gguf.is_file() else default_gguf_path()
    command = [
        str(llama_bench), "-m", str(gguf), "-t", str(args.threads), "-p", str(args.prefill_tokens),
        "-n", str(args.new_tokens), "-d", ",".join(sorted({"0", str(args.depth)})),
        "-r", str(repetitions), "-o", "json",
    ]  # fmt: skip
    stdout, command = run_llama_cpp(command, ["--repack", "0"], timeout_s=1800)
    runs = json.loads(stdout)
    prefill = next(r for r in runs if r["n_prompt"] > 0 and r["n_gen"] == 0 and r.get("n_depth", 0) == 0)
    decode = next(
        r for r in runs if r["n_gen"] > 0 and r["n_prompt"] == 0 and r.get("n_depth", 0) == args.depth
    )
    return {
        "prefill_tok_s": float(prefill["avg_ts"]),
        "decode": {"1": {"tok_s": float(decode["avg_ts"])}},
        "gguf": str(gguf),
        "command": " ".join(command),
        "build": str(runs[0].get("build_commit", "")),
    }


# -- our engine ----------------------------------------------------------------------------------------


def measure_engine(
    args: argparse.Namespace,
    engine: Any,
    prompts: list[list[int]],
    prefill_prompts: list[list[int]],
    batches: list[int],
) -> dict[str, Any]:
    """One round on a built engine: prefill tok/s (median of the prompts after the first), then decode at
    each batch size; "started" is the round's wall-clock start (time.time()), to order it among others."""
    started = time.time()
    prefill_times = []
    for i, prompt in enumerate(prefill_prompts):
        t0 = time.perf_counter()
        run_batch(engine, [prompt], 1, f"prefill{i}")
        prefill_times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {
        "started": started,
        "prefill_tok_s": args.prefill_tokens / median(prefill_times[1:]),
        "decode": {},
    }
    for b in batches:
        out["decode"][str(b)] = run_batch(engine, prompts[:b], args.new_tokens, f"b{b}")
    return out


def describe_engine(engine: Any, weights: str) -> dict[str, Any]:
    """What a side served: its weights setting, KV cache dtype and the weight bytes a decode step reads."""
    from services.engine.kv_export import dtype_name

    served = engine.served
    return {
        "weights": weights,
        "served_weights": served.weights,
        "small_step_max_tokens": served.small_step_max_tokens,
        "numerics": served.numerics,
        "weight_bytes": served.weight_bytes,
        "kv_cache_dtype": dtype_name(engine.kv_dtype),
        "step_weight_bytes": step_weight_bytes(engine.runner.model),
    }


def step_weight_bytes(model: Any) -> int:
    """The bytes of weights one decode step reads: every layer's projections and the LM head, as stored."""
    from services.engine.ops.fused_layers import PROJECTIONS

    matrices = [getattr(layer, name) for layer in getattr(model, "stored_layers", []) for name in PROJECTIONS]
    matrices.append(getattr(model, "lm_head_stored", None))
    data = [getattr(w, "data", w) for w in matrices if w is not None]
    return sum(t.numel() * t.element_size() for t in data) or int(model.weight_bytes)


def build_engine(
    args: argparse.Namespace,
    batch_size_limit: int,
    weights: str = "auto",
    kv_cache_dtype: str = "auto",
    *,
    deterministic: bool = False,
) -> Any:
    """An engine core for `args.model` at `args.dtype` over `weights` (model.weights) with a KV cache of
    `kv_cache_dtype` (engine.kv_cache_dtype), under engine.deterministic or not, warmed up."""
    from services.common.config import load_config
    from services.engine.loading.factory import build_core

    cfg = load_config(None)
    model_update = {"path": str(args.model), "dtype": args.dtype, "weights": weights}
    cfg = cfg.model_copy(
        update={
            "model": cfg.model.model_copy(update=model_update),
            "engine": cfg.engine.model_copy(
                update={"kv_cache_dtype": kv_cache_dtype, "deterministic": deterministic}
            ),
            "limits": cfg.limits.model_copy(update={"batch_size_limit": batch_size_limit}),
        }
    )
    engine = build_core(cfg)
    run_batch(engine, [list(range(100, 116))] * 2, 4, "warm")
    return engine


def run_batch(
    engine: Any, prompts: list[list[int]], new_tokens: int, tag: str, params: SamplingParams | None = None
) -> dict[str, float]:
    """All `prompts` at once, greedy (unless `params` says otherwise), `new_tokens` each: decode tok/s
    after every first token, TTFT; and how often the scheduler preempted a sequence for want of KV blocks
    (each then recomputes its prefill, in the rates: a long `--depth` at a large batch can do that)."""
    params = params or SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    engine.pool.reset_cache()
    preempted_before = engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    first: dict[str, float] = {}
    stamps: list[tuple[float, int]] = []  # (time, tokens produced this step)
    num_tokens = 0
    while engine.has_work():
        outputs = engine.step()
        now = time.perf_counter()
        for o in outputs:
            first.setdefault(o.request_id, now)
            num_tokens += len(o.new_token_ids)
        stamps.append((now, len(outputs)))
    t_all_first = max(first.values())
    decode_tokens = sum(n for t, n in stamps if t > t_all_first)
    decode_s = stamps[-1][0] - t_all_first
    return {
        "tok_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        "ttft_ms": 1000 * median([t - t0 for t in first.values()]),
        "e2e_tok_s": len(prompts) * new_tokens / (stamps[-1][0] - t0),
        "num_tokens": num_tokens,
        "preemptions": engine.scheduler.num_preemptions - preempted_before,
    }


# -- transformers' generate ----------------------------------------------------------------------------


def measure_baseline(
    args: argparse.Namespace, prompts: list[list[int]], prefill_prompts: list[list[int]], batches: list[int]
) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    # Loaded straight into bf16: the same round-to-nearest cast as loading fp32 and calling .to(bf16).
    model = AutoModelForCausalLM.from_pretrained(
        str(args.model), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    model.eval()
    with torch.inference_mode():
        times = []
        for prompt in prefill_prompts:
            ids = torch.tensor([prompt])  # [1, prefill_tokens]
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"prefill_tok_s": args.prefill_tokens / median(times[1:]), "decode": {}}
    pad_id = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 0
    for b in batches:
        out["decode"][str(b)] = _generate_batch(model, prompts[:b], pad_id, args.new_tokens)
    return out


def _generate_batch(model: Any, batch: list[list[int]], pad_id: int, new_tokens: int) -> dict[str, float]:
    """One left-padded greedy `generate` of `new_tokens` per prompt, after a 4-token warm-up."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.times.append(time.perf_counter())
            return scores

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch])  # [batch, width], left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])  # [batch, width]
    kw = {"input_ids": ids, "attention_mask": mask, "do_sample": False, "pad_token_id": pad_id}
    with torch.inference_mode():
        model.generate(**kw, max_new_tokens=4, min_new_tokens=4)
        stamp = Stamp()
        t0 = time.perf_counter()
        generated = model.generate(
            **kw,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            logits_processor=LogitsProcessorList([stamp]),
        )
        wall = time.perf_counter() - t0
    span = stamp.times[-1] - stamp.times[0]
    return {
        "tok_s": len(batch) * (len(stamp.times) - 1) / span,
        "ttft_ms": 1000 * (stamp.times[0] - t0),
        "e2e_tok_s": len(batch) * new_tokens / wall,
        "num_tokens": len(batch) * (generated.shape[1] - width),
    }
