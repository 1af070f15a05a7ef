"""Building an engine core and its parts from config: the block pool, KV cache manager, scheduler, and a
runner over the loaded model with its KV cache tensors, on the device `engine.device` names.

On a CPU the KV cache takes `engine.kv_cache_memory_mb`. On a GPU it takes what is left of the engine's
share of the device (`engine.gpu_memory_utilization`) after the weights and one warm-up forward of a full
step's tokens (services/engine/loading/device.py has the rule and its refusals).

`assemble_core` takes the runner as a function of the planned KV cache, so tests build the same core
over a fake runner without a model directory. A core built from a directory gets grammar matchers over
its tokenizer.json (built on first use, grammar_matchers.py); one over a state dict has none unless given.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from services.common.config import EngineConfig, KvrelayConfig
from services.common.errors import ConfigError
from services.common.manifest import Manifest
from services.common.sampling import MAX_LOGPROBS, SamplingParams
from services.engine.core import EngineCore, ServedWeights
from services.engine.cuda_graphs import DecodeGraphs, estimate_graph_bytes
from services.engine.kv_export import dtype_name
from services.engine.kv_tiers import build_kv_tiers
from services.engine.layers.attention_backend import PagedAttention, TorchAttention
from services.engine.layers.attention_metadata import RowSpec, build_metadata, to_device
from services.engine.layers.grammar_matchers import GrammarMatchers
from services.engine.layers.kv_cache import (
    KVCacheSpec,
    allocate_kv_caches,
    check_host_memory,
    plan_num_blocks,
)
from services.engine.layers.sampler import SamplingBatch, SamplingRow, sample_on_device
from services.engine.loading.device import (
    CudaMemoryProbe,
    MemoryReading,
    check_weights_fit,
    default_batch_size_limit,
    default_batched_tokens,
    measure_device_memory,
    plan_device_blocks,
    read_memory,
    resolve_device,
)
from services.engine.loading.loader import KV_CACHE_DTYPES, LoadedModel, load_model, stored_weight_bytes
from services.engine.model_config import ModelConfig
from services.engine.models.registry import CausalLM
from services.engine.runner import ModelRunner
from services.engine.runner_protocol import Runner
from services.engine.scheduling.block_pool import BlockPool
from services.engine.scheduling.kv_manager import KVCacheManager, PrefixCacheStats
from services.engine.scheduling.scheduler import Scheduler
from services.kvcache.segment import Namespace

log = logging.getLogger(__name__)

# Builds the runner once the KV cache is planned: the cache's layout and how many blocks it holds.
RunnerFactory = Callable[[KVCacheSpec, int], Runner]
# How many KV blocks of a spec the engine gets, given max_model_len.
BlockPlanner = Callable[[KVCacheSpec, int], int]


def max_model_len_for(config: ModelConfig, engine: EngineConfig) -> int:
    """`engine.max_model_len`, capped at what the model's positions allow (the model's when unset)."""
    return min(engine.max_model_len or config.max_position_embeddings, config.max_position_embeddings)


def build_scheduler(
    config: ModelConfig,
    engine: EngineConfig,
    num_blocks: int,
    batch_size_limit: int,
    device: torch.device | None = None,
) -> Scheduler:
    """A scheduler over a fresh pool of `num_blocks` blocks and its KV cache manager."""
    pool = BlockPool(num_blocks, enable_caching=engine.enable_prefix_caching)
    kv = KVCacheManager(pool, engine.block_size, PrefixCacheStats(), window=config.kv_window)
    budget = default_batched_tokens(device or torch.device("cpu"), engine.max_num_batched_tokens)
    scheduler = Scheduler(kv, budget, batch_size_limit)
    if config.is_encoder_decoder:  # the sources a step may encode: its own budget, the step's by default
        scheduler.max_num_encoder_tokens = engine.max_num_encoder_tokens or budget
    return scheduler


def assemble_core(
    config: ModelConfig,
    manifest: Manifest,
    engine: EngineConfig,
    batch_size_limit: int,
    kv_dtype: torch.dtype,
    runner_for: RunnerFactory,
    *,
    plan_blocks: BlockPlanner | None = None,
    device: torch.device | None = None,
    grammars: GrammarMatchers | None = None,
    served: ServedWeights | None = None,
) -> EngineCore:
    """Plan the KV cache (within `engine.kv_cache_memory_mb` unless `plan_blocks` says otherwise), then
    build the scheduler and the runner."""
    max_model_len = max_model_len_for(config, engine)
    spec = KVCacheSpec.for_model(config, engine.block_size, kv_dtype)
    # The tokens one sequence may hold: an encoder-decoder sequence holds its source's cross KV too.
    sequence_tokens = max_model_len * (2 if config.is_encoder_decoder else 1)
    if plan_blocks is None:
        num_blocks = plan_num_blocks(spec, engine.kv_cache_memory_mb, sequence_tokens)
    else:
        num_blocks = plan_blocks(spec, sequence_tokens)
    runner = runner_for(spec, num_blocks)
    scheduler = build_scheduler(config, engine, num_blocks, batch_size_limit, device)
    on_gpu = device is not None and device.type == "cuda"
    overlap = on_gpu if engine.overlap is None else engine.overlap
    return EngineCore(
        config, manifest, scheduler, runner, max_model_len=max_model_len, overlap=overlap, grammars=grammars,
        served=served,
    )  # fmt: skip


def build_core(config: KvrelayConfig) -> EngineCore:
    """Load the prepared model directory `config.model.path` onto `engine.device` and build a core."""
    if config.engine.num_threads:
        torch.set_num_threads(config.engine.num_threads)
    device = resolve_device(config.engine.device)
    before_load: MemoryReading | None = None
    if device.type == "cuda":
        torch.cuda.set_device(device)  # kernels, streams and events of this process go to `device`
        gc.collect()  # engines dropped earlier free their tensors into the allocator's cache now
        before_load = read_memory(CudaMemoryProbe(device))  # creates the CUDA context first
        weights = stored_weight_bytes(config.model.path, config.model.dtype)
        util = config.engine.gpu_memory_utilization
        check_weights_fit(weights, before_load.total_bytes, before_load.available_bytes, util)
    loaded = load_for(config, device)
    grammars = GrammarMatchers(
        Path(config.model.path) / "tokenizer.json", loaded.config.eos_token_ids, loaded.config.vocab_size
    )
    return build_core_from_loaded(loaded, config, before_load=before_load, grammars=grammars)


def load_for(config: KvrelayConfig, device: torch.device | None = None) -> LoadedModel:
    """The model `config` names, loaded as its model and engine sections say (on the CPU by default)."""
    engine = config.engine
    model = config.model
    device = device or torch.device("cpu")
    return load_model(
        model.path,
        model.dtype,
        device,
        attention=engine.attention,
        block_size=engine.block_size,
        weights=model.weights,
        kv_cache_dtype=engine.kv_cache_dtype,
        small_step_max_tokens=engine.small_step_max_tokens,
        kv_cache_bytes=engine.kv_cache_memory_mb * 2**20 if device.type == "cpu" else 0,
        deterministic=engine.deterministic,
    )


def build_core_from_loaded(
    loaded: LoadedModel,
    config: KvrelayConfig,
    *,
    before_load: MemoryReading | None = None,
    grammars: GrammarMatchers | None = None,
) -> EngineCore:
    """A core over an already loaded model (a directory's, or a state dict's: loader.load_state_dict), on
    the device its weights are on. `before_load`: the device's memory read before the weights were placed
    (none for a state dict built elsewhere: then the engine is charged `loaded.weight_bytes` for its
    weights, device.account_engine_memory). `grammars`: see EngineCore (None refuses grammars)."""
    engine = config.engine
    device = loaded.model.device
    batch_size_limit = default_batch_size_limit(device, config.limits.batch_size_limit)
    named = KV_CACHE_DTYPES.get(engine.kv_cache_dtype)  # None: auto, whatever the load resolved
    if named is not None and named != loaded.model.kv_dtype:
        raise ConfigError(
            f"engine.kv_cache_dtype is {engine.kv_cache_dtype}, but the model was loaded with a "
            f"{str(loaded.model.kv_dtype).removeprefix('torch.')} KV cache: load it with "
            f"kv_cache_dtype={engine.kv_cache_dtype!r}"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    paged = loaded.model.paged
    graphs_on = _graphs_on(engine.cuda_graphs, paged, device) and not loaded.config.is_encoder_decoder
    if paged.block_size not in (None, engine.block_size):
        raise ConfigError(
            f"the model's attention was specialised for KV blocks of {paged.block_size} tokens, but "
            f"engine.block_size is {engine.block_size}: load it with block_size={engine.block_size}"
        )

    max_blocks = -(-max_model_len_for(loaded.config, engine) // engine.block_size)
    graph_estimate = estimate_graph_bytes(loaded.config, batch_size_limit, max_blocks, loaded.model.dtype)

    def model_runner(spec: KVCacheSpec, num_blocks: int) -> Runner:
        if device.type == "cpu":
            check_host_memory(loaded.weight_bytes, num_blocks * spec.bytes_per_block)
        caches = allocate_kv_caches(spec, num_blocks, device)
        runner = ModelRunner(loaded.model, caches, engine.block_size, loaded.config.vocab_size, engine.seed)
        if graphs_on:
            graphs = DecodeGraphs(
                loaded.model, paged, caches, engine.block_size, batch_size_limit, max_blocks
            )
            runner.graphs = _captured(
                graphs, graph_estimate, loaded.model, required=engine.cuda_graphs is True
            )
        return runner

    plan_blocks: BlockPlanner | None = None
    if device.type == "cuda":
        probe = CudaMemoryProbe(device)
        budget = default_batched_tokens(device, engine.max_num_batched_tokens)

        def plan_blocks(spec: KVCacheSpec, max_model_len: int) -> int:
            def step() -> int:
                return warm_up(loaded.model, spec, min(budget, max_model_len), batch_size_limit, device)

            gc.collect()  # so no earlier engine's tensors are freed during the warm-up's peak
            memory = measure_device_memory(probe, step, loaded.weight_bytes, before_load)
            util = engine.gpu_memory_utilization
            graph_bytes = graph_estimate if graphs_on else 0
            return plan_device_blocks(
                spec.bytes_per_block, spec.block_size, memory, util, max_model_len, graph_bytes
            )

    core = assemble_core(
        loaded.config,
        loaded.manifest,
        engine,
        batch_size_limit,
        loaded.model.kv_dtype,
        model_runner,
        plan_blocks=plan_blocks,
        device=device,
        grammars=grammars,
        served=served_weights(loaded),
    )
    if config.kv_tiers.is_enabled:
        namespace = tier_namespace(loaded, engine.block_size, config.kv_tiers.segment_tokens)
        runner, environ = core.runner, dict(os.environ)
        core.use_tiers(
            build_kv_tiers(config.kv_tiers, namespace, runner.read_kv, runner.write_kv, device, environ)
        )
    return core


def tier_namespace(loaded: LoadedModel, block_size: int, segment_tokens: int) -> Namespace:
    """Everything of this served model that changes its KV bytes (services/kvcache/segment.py)."""
    config = loaded.config
    return Namespace(
        model_fingerprint=loaded.manifest.model_fingerprint,
        weights=loaded.weights,
        compute_dtype=dtype_name(loaded.model.dtype),
        kv_dtype=dtype_name(loaded.model.kv_dtype),
        block_size=block_size,
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        segment_tokens=segment_tokens,
    )


def served_weights(loaded: LoadedModel) -> ServedWeights:
    threshold = loaded.step_threshold
    return ServedWeights(
        loaded.weights,
        loaded.weight_bytes,
        None if threshold is None else threshold.max_tokens,
        "" if threshold is None else threshold.source,
        loaded.numerics,
    )


def _captured(
    graphs: DecodeGraphs, planned_bytes: int, model: CausalLM, *, required: bool
) -> DecodeGraphs | None:
    """The graphs once captured; when capture fails and they were not asked for explicitly, None (the
    engine runs every step eagerly, logged), so the default is never worse than eager. A Triton kernel that
    fails to build there would fail the eager steps too (its constexprs are the model's), so the model
    also leaves the Triton kernels for torch-native attention, which reads the same cache. Graphs that took
    more than the KV plan set aside for them are logged: that is the headroom they ate into."""
    try:
        graphs.capture()
    except _capture_errors() as exc:
        if required:
            raise
        reason = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, (RuntimeError, torch.OutOfMemoryError)):
            log.warning("decode graph capture failed; running eagerly", extra={"reason": reason})
        else:
            model.paged = TorchAttention()
            log.warning(
                "a Triton kernel failed at decode graph capture; torch-native attention, eagerly",
                extra={"reason": reason},
            )
        return None
    if graphs.graph_bytes > planned_bytes:
        log.warning(
            "decode graphs took more memory than the KV plan set aside",
            extra={"graph_bytes": graphs.graph_bytes, "planned_bytes": planned_bytes},
        )
    return graphs


def _capture_errors() -> tuple[type[Exception], ...]:
    """What a failed capture raises: CUDA errors and out-of-memory (RuntimeError), and, with Triton
    installed, Triton's own errors, none of them a RuntimeError: a kernel that does not compile for this
    GPU (CompilationError) or does not fit it (OutOfResources, PTXASError), first met in the warm-up."""
    errors: tuple[type[Exception], ...] = (RuntimeError, torch.OutOfMemoryError)
    try:
        from triton.errors import TritonError
    except ImportError:  # no Triton: no Triton kernels to fail
        return errors
    return (*errors, TritonError)


def _graphs_on(setting: bool | None, paged: PagedAttention, device: torch.device) -> bool:
    """`engine.cuda_graphs`: unset means on a GPU whose attention can be captured."""
    if setting is None:
        return device.type == "cuda" and paged.graph_safe
    if setting and not paged.graph_safe:
        raise ConfigError(
            f"engine.cuda_graphs needs graph-safe attention (engine.attention: triton), not {paged.name}"
        )
    return setting


# The costliest sampling a row can ask for: what the warm-up runs on every row of a full step.
WARM_UP_SAMPLING = SamplingParams(
    temperature=1.0, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, frequency_penalty=0.1,
    presence_penalty=0.1, seed=0, logprobs=MAX_LOGPROBS, max_tokens=1,
)  # fmt: skip


def warm_up(
    model: CausalLM, spec: KVCacheSpec, num_tokens: int, num_samples: int, device: torch.device
) -> int:
    """One forward of a full step (`num_tokens` prompt tokens, logits for `num_samples` of them) over a
    scratch cache, then the sampler over those rows with every feature on (penalties, top-k, top-p: a full
    sort of each row on a GPU, logprobs, seeds), so the allocator's peak holds the step's activations
    before the KV cache is sized. Returns the scratch cache's bytes, which that peak also holds but the KV
    cache replaces."""
    num_blocks = -(-num_tokens // spec.block_size)
    caches = allocate_kv_caches(spec, num_blocks, device)
    meta = build_metadata([], [RowSpec(list(range(num_blocks)), 0, num_tokens)], spec.block_size, device)
    token_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)  # [num_tokens]
    samples = to_device(list(range(max(0, num_tokens - num_samples), num_tokens)), device)  # [num_samples]
    logits = model.forward(token_ids, caches, meta, samples)  # [num_samples, vocab]
    rows = [SamplingRow(WARM_UP_SAMPLING, [1, 2, 3], [4])] * logits.shape[0]
    batch = SamplingBatch.build(rows, logits.shape[1], device)
    sample_on_device(logits, batch, torch.Generator(device=device).manual_seed(0))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    del caches
    return num_blocks * spec.bytes_per_block
