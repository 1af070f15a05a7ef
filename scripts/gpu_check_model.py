"""gpu_check's model stages: the shapes, random-weight transformers Llamas and kvrelay's engine over the
same weights (handed over as a state dict, never through disk), and stages 0 smoke, 1 copy, 2 identity,
3 cosine, 4 speed, 5 baseline and 8 graphs. Run through scripts/gpu_check.py, which puts the repository
root on sys.path; services are imported inside the functions."""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
        "rope_theta": 500000.0, "max_position_embeddings": 8192,
    },
    "llama-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "tie_word_embeddings": False,
        "rope_theta": 500000.0, "max_position_embeddings": 8192,
    },
    "tiny": {
        "hidden_size": 128, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 256, "tie_word_embeddings": True,
        "rope_theta": 10000.0, "max_position_embeddings": 512,
    },
}  # fmt: skip
CUDA_PATH_MODULES = (
    "services.common.config",
    "services.engine.loading.device",
    "services.engine.loading.loader",
    "services.engine.loading.factory",
    "services.engine.core",
    "services.engine.runner",
    "services.engine.layers.attention",
    "services.engine.layers.attention_backend",
    "services.engine.ops.triton.launch",
    "services.engine.layers.sampler",
    "services.engine.models.llama",
    "services.engine.models.gemma3",
    "services.engine.models.qwen",
)


def hf_config(shape: str, dtype: Any, **overrides: Any) -> Any:
    from transformers import LlamaConfig

    settings = {**SHAPES[shape], "bos_token_id": 0, "eos_token_id": 1, **overrides}
    config = LlamaConfig(**settings, architectures=["LlamaForCausalLM"])
    config._attn_implementation = "sdpa"
    return config


def build_hf(shape: str, device: str, dtype: Any, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight transformers Llama built directly on the device."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = hf_config(shape, dtype, **overrides)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    return model


def build_engine(hf_model: Any, device: str, dtype: str, kv_tiers: dict[str, Any] | None = None, **engine: Any
                 ) -> Any:  # fmt: skip
    """kvrelay's engine over the same weights, handed over as a state dict (no disk); `kv_tiers`: the
    KV tiers below its pool (none by default)."""
    from services.common.config import KvrelayConfig
    from services.engine.loading.factory import build_core_from_loaded
    from services.engine.loading.loader import load_state_dict

    config_dict = hf_model.config.to_dict()
    loaded = load_state_dict(
        config_dict, hf_model.state_dict(), dtype=dtype, fingerprint=f"gpu-check-{id(hf_model)}",
        attention=engine.get("attention", "auto"), block_size=engine.get("block_size", 16),
        kv_cache_dtype=engine.get("kv_cache_dtype", "auto"),
    )  # fmt: skip
    settings = {
        "engine": {"device": device, "enable_prefix_caching": False, **engine},
        "model": {"dtype": dtype},
        "kv_tiers": kv_tiers or {},
    }
    return build_core_from_loaded(loaded, KvrelayConfig.model_validate(settings))


def greedy(core: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from services.common.sampling import SamplingParams

    # EOS banned throughout, as transformers' min_new_tokens does (ignore_eos would still sample it)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, params)
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_work():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
    return [out[f"r{i}"] for i in range(len(prompts))]


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(num)]


def stage_smoke(args: argparse.Namespace) -> dict[str, Any]:
    import importlib

    import torch

    started = time.perf_counter()
    for name in CUDA_PATH_MODULES:
        importlib.import_module(name)
    dtype = torch.float32
    hf = build_hf("tiny", args.device, dtype)
    core = build_engine(hf, args.device, "float32", kv_cache_memory_mb=16, gpu_memory_utilization=0.2)
    prompt = random_prompts(1, 12, SHAPES["tiny"]["vocab_size"], 0)[0]
    tokens = greedy(core, [prompt], 8)[0]
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt], device=args.device), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )
    expected = ref[0, len(prompt) :].tolist()
    return {
        "ok": tokens == expected,
        "device": str(core.device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "tokens": tokens,
        "transformers_tokens": expected,
        "seconds": round(time.perf_counter() - started, 2),
    }


def stage_copy(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    n = args.copy_mib * 2**20 // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=args.device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds = timed(args.device, lambda: [dst.copy_(src) for _ in range(10)]) / 10
    gb_per_s = 2 * src.numel() * src.element_size() / seconds / 1e9  # read + write
    return {"ok": True, "bytes": src.numel() * src.element_size(), "gb_per_s": round(gb_per_s, 1)}


def stage_identity(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    overrides = {"num_hidden_layers": 4, "initializer_range": 0.2}
    shape = args.check_shape
    hf = build_hf(shape, args.device, torch.float32, **overrides)
    core = build_engine(hf, args.device, "float32", gpu_memory_utilization=0.3)
    prompts = random_prompts(4, 48, SHAPES[shape]["vocab_size"], 1)
    num_tokens = args.identity_tokens
    tokens = greedy(core, prompts, num_tokens)
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = hf.generate(
                torch.tensor([prompt], device=args.device),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
            )
            expected.append(out[0, len(prompt) :].tolist())
    same = [a == b for a, b in zip(tokens, expected, strict=True)]
    first_diff = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
                  for a, b in zip(tokens, expected, strict=True)]  # fmt: skip
    # The engine above overlaps steps (the GPU default): the plain loop must give the same tokens.
    plain_core = build_engine(hf, args.device, "float32", gpu_memory_utilization=0.3, overlap=False)
    plain = greedy(plain_core, prompts, num_tokens)
    return {
        "ok": all(same) and plain == tokens, "identical": same, "first_difference": first_diff,
        "num_tokens": num_tokens, "attention": type(core.runner.model.paged).__name__,
        "overlap": core.overlap, "overlap_matches_plain": plain == tokens,
    }  # fmt: skip


def stage_cosine(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from services.engine.loading.loader import load_state_dict

    shape = args.check_shape
    num_layers = min(8, SHAPES[shape]["num_hidden_layers"])
    hf = build_hf(shape, args.device, torch.bfloat16, num_hidden_layers=num_layers)
    loaded = load_state_dict(hf.config.to_dict(), hf.state_dict(), dtype="bfloat16")
    prompts = random_prompts(4, 64, SHAPES[shape]["vocab_size"], 2)
    ours = [model_logits(loaded, p, args.device) for p in prompts]
    with torch.no_grad():
        theirs = [hf(torch.tensor([p], device=args.device)).logits[0, -1].float() for p in prompts]
    cosines = [
        float(torch.nn.functional.cosine_similarity(a, b, dim=0)) for a, b in zip(ours, theirs, strict=True)
    ]
    return {"ok": min(cosines) >= 0.999, "cosines": [round(c, 6) for c in cosines], "threshold": 0.999}


def model_logits(loaded: Any, prompt: list[int], device: str) -> Any:
    """The engine model's float32 logits at the prompt's last position: one prefill over fresh blocks."""
    import torch

    from services.engine.layers.attention_metadata import RowSpec, build_metadata
    from services.engine.layers.kv_cache import KVCacheSpec, allocate_kv_caches

    block_size = 16
    num_blocks = -(-len(prompt) // block_size)
    spec = KVCacheSpec.for_model(loaded.config, block_size, loaded.model.kv_dtype)
    caches = allocate_kv_caches(spec, num_blocks, torch.device(device))
    row = RowSpec(list(range(num_blocks)), 0, len(prompt))
    meta = build_metadata([], [row], block_size, device=torch.device(device))
    token_ids = torch.tensor(prompt, device=device)
    last = torch.tensor([len(prompt) - 1], device=device)
    return loaded.model.forward(token_ids, caches, meta, last)[0]


def stage_speed(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    results: dict[str, Any] = {}
    for shape in args.shapes.split(","):
        hf = build_hf(shape, args.device, torch.bfloat16)
        first = args.attentions.split(",")[0]
        runs = [(a, None, None) for a in args.attentions.split(",")]
        runs += [(first, False, None), (first, None, False)]
        for attention, overlap, graphs in runs:
            core = build_engine(
                hf, args.device, "bfloat16", gpu_memory_utilization=0.8, max_num_batched_tokens=4096,
                attention=attention, overlap=overlap, cuda_graphs=graphs,
            )  # fmt: skip
            key = shape if attention == "auto" else f"{shape}/{attention}"
            key += "/no_overlap" if overlap is False else "/no_graphs" if graphs is False else ""
            full = overlap is None and graphs is None
            batches = (1, 64) if overlap is False else (1, 8, 64)
            results[key] = _speed_row(args, core, shape, ttft=full, batches=batches)
            del core
            gc.collect()
            torch.cuda.empty_cache() if torch.cuda.is_available() else None
        del hf
    return {"ok": True, **results}


def _speed_row(
    args: argparse.Namespace, core: Any, shape: str, *, ttft: bool, batches: tuple[int, ...]
) -> dict[str, Any]:
    """TTFT of a long prompt (when `ttft`) and decode rates at each of `batches`."""
    vocab = SHAPES[shape]["vocab_size"]
    row: dict[str, Any] = {"attention": type(core.runner.model.paged).__name__, "overlap": core.overlap}
    graphs = core.runner.graphs
    row["graphs"] = None if graphs is None else {
        "buckets": len(graphs.buckets), "capture_s": round(graphs.capture_seconds, 2),
        "graph_mib": round(graphs.graph_bytes / 2**20, 1),
    }  # fmt: skip
    if ttft:
        length = min(2048, SHAPES[shape]["max_position_embeddings"] - 64)
        row[f"ttft_{length}_ms"] = round(1000 * _ttft(core, random_prompts(1, length, vocab, 3)[0]), 1)
    for batch in batches:
        tok_s, host_ms = _decode_rate(core, random_prompts(batch, 128, vocab, 4 + batch), args.decode_steps)
        row[f"decode_tok_s_b{batch}"] = round(tok_s, 1)
        row[f"host_ms_per_step_b{batch}"] = round(host_ms, 3)
    return row


def _ttft(core: Any, prompt: list[int]) -> float:
    from services.common.sampling import SamplingParams

    greedy(core, [prompt[:64]], 1)  # warm-up
    core.add_request("ttft", prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    started = time.perf_counter()
    while core.has_work():
        core.step()
    return time.perf_counter() - started


def _decode_rate(core: Any, prompts: list[list[int]], steps: int) -> tuple[float, float]:
    """Decode tokens per second once every prompt is in, and the host milliseconds per step spent before
    the forward is launched (building inputs: the part CUDA graphs and overlap do not hide)."""
    from services.common.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(f"d{i}", prompt, params)
    while core.stats().num_waiting:
        core.step()
    for _ in range(4):
        core.step()
    marks: list[float] = []
    core.set_before_forward(lambda: marks.append(time.perf_counter()))
    host = 0.0
    num_tokens = 0
    started = time.perf_counter()
    for _ in range(steps):
        step_start = time.perf_counter()
        num_tokens += sum(len(o.new_token_ids) for o in core.step())
        host += marks[-1] - step_start
    seconds = time.perf_counter() - started
    core.set_before_forward(None)
    core.abort([f"d{i}" for i in range(len(prompts))])
    return num_tokens / seconds, 1000 * host / steps


def stage_baseline(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    results: dict[str, Any] = {}
    for shape in args.shapes.split(","):
        hf = build_hf(shape, args.device, torch.bfloat16)
        vocab = SHAPES[shape]["vocab_size"]
        row = {}
        steps = args.decode_steps
        for batch in (1, 64):
            ids = torch.tensor(random_prompts(batch, 128, vocab, 5), device=args.device)
            with torch.no_grad():
                hf.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
                started = time.perf_counter()
                hf.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False)
                timed(args.device, lambda: None)  # waits for the device
                seconds = time.perf_counter() - started
            row[f"generate_tok_s_b{batch}"] = round(batch * steps / seconds, 1)
        results[shape] = row
        del hf
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"ok": True, **results}


def timed(device: str, work: Callable[[], object]) -> float:
    """Seconds `work` takes, with the device synchronized before and after it on a GPU."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
    started = time.perf_counter()
    work()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - started


def stage_graphs(args: argparse.Namespace) -> dict[str, Any]:
    """A decode step of 5 rows through the 8-row bucket's graph, against the same bucket's forward run
    eagerly over the same static buffers: bit for bit. Capture time and memory from the engine."""
    import torch

    from services.engine.layers.attention_metadata import RowSpec, build_metadata

    shape = args.check_shape
    hf = build_hf(
        shape, args.device, torch.bfloat16, num_hidden_layers=min(4, SHAPES[shape]["num_hidden_layers"])
    )
    core = build_engine(hf, args.device, "bfloat16", gpu_memory_utilization=0.3, attention="triton",
                        cuda_graphs=True)  # fmt: skip
    graphs = core.runner.graphs
    contexts = [3, 17, 40, 100, 257]
    rows = [RowSpec([(7 * r + i) % 64 for i in range(-(-c // 16))], c - 1, 1) for r, c in enumerate(contexts)]
    meta = build_metadata(rows, [], 16, torch.device(args.device))
    tokens = torch.tensor([11, 12, 13, 14, 15], device=args.device)
    bucket = graphs.load(tokens, meta)
    replayed = graphs.replay(bucket).clone()
    eager = graphs.eager(bucket).clone()
    same = bool(torch.equal(replayed, eager))
    return {
        "ok": same, "bucket": bucket, "bit_identical": same,
        "max_abs_difference": float((replayed.float() - eager.float()).abs().max()),
        "buckets": graphs.buckets, "capture_s": round(graphs.capture_seconds, 2),
        "graph_mib": round(graphs.graph_bytes / 2**20, 1),
    }  # fmt: skip
