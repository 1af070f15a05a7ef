"""RoPE scaling as published checkpoints configure it (Llama 3.x llama3, Qwen2.5/Qwen3 yarn, Gemma 3
linear): our frequencies and attention factor against transformers' for every spelling of the config,
tiny random models teacher-forced against transformers' logits on both Llama paths (torch, C kernels),
and the RoPE types we refuse."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

from services.common.errors import ModelLoadError
from services.engine.layers.attention_metadata import RowSpec, build_metadata
from services.engine.layers.kv_cache import KVCacheSpec, allocate_kv_caches
from services.engine.layers.rope import RotaryEmbedding, attention_factor, cos_sin_at, inverse_frequencies
from services.engine.loading.loader import LoadedModel, load_state_dict
from services.engine.model_config import FULL_ATTENTION, SLIDING_ATTENTION, ModelConfig
from services.engine.ops.cpu_features import can_run_cpu_kernels, cpu_flags
from tests.tiny_model import TINY_LLAMA


@dataclasses.dataclass(frozen=True)
class Published:
    """The RoPE-relevant fields of a released checkpoint's config.json, with transformers' config class."""

    architecture: str
    config_class: type
    hidden_size: int
    num_heads: int
    head_dim: int
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict[str, Any]  # as config.json spells it, without the type key
    rope_type: str
    layer_types: tuple[str, ...] = (FULL_ATTENTION,)
    extra: tuple[tuple[str, Any], ...] = ()

    def raw(self, rope_scaling: dict[str, Any] | None) -> dict[str, Any]:
        """A config.json in the transformers 4.x spelling: `rope_theta` beside `rope_scaling`."""
        return {
            "architectures": [self.architecture],
            "vocab_size": 1024,
            "hidden_size": self.hidden_size,
            "intermediate_size": 4 * self.hidden_size,
            "num_hidden_layers": len(self.layer_types),
            "num_attention_heads": self.num_heads,
            "head_dim": self.head_dim,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": list(self.layer_types),
            "rope_scaling": rope_scaling,
            **dict(self.extra),
        }

    def hf_config(self) -> Any:
        fields = self.raw({"rope_type": self.rope_type, **self.rope_scaling})
        del fields["architectures"]
        fields.pop("model_type", None)
        return self.config_class(**fields)


LLAMA3 = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
QWEN_YARN = {"factor": 4.0, "original_max_position_embeddings": 32768}
PUBLISHED = {
    "llama-3.1-8b": Published(
        "LlamaForCausalLM", LlamaConfig, 4096, 32, 128, 500000.0, 131072, LLAMA3, "llama3"
    ),
    "llama-3.2-1b": Published(
        "LlamaForCausalLM", LlamaConfig, 2048, 32, 64, 500000.0, 131072, {**LLAMA3, "factor": 32.0}, "llama3"
    ),
    "llama-3.3-70b": Published(
        "LlamaForCausalLM", LlamaConfig, 8192, 64, 128, 500000.0, 131072, LLAMA3, "llama3"
    ),
    "qwen2.5-7b-yarn": Published(
        "Qwen2ForCausalLM", Qwen2Config, 3584, 28, 128, 1e6, 32768, QWEN_YARN, "yarn"
    ),
    "qwen3-8b-yarn": Published("Qwen3ForCausalLM", Qwen3Config, 4096, 32, 128, 1e6, 40960, QWEN_YARN, "yarn"),
    "gemma-3-4b-text": Published(
        "Gemma3ForCausalLM",
        Gemma3TextConfig,
        2560,
        8,
        256,
        1e6,
        131072,
        {"factor": 8.0},
        "linear",
        layer_types=(SLIDING_ATTENTION, FULL_ATTENTION),
        extra=(("rope_local_base_freq", 10000.0), ("sliding_window", 1024), ("model_type", "gemma3_text")),
    ),
}


def spellings(published: Published) -> dict[str, dict[str, Any]]:
    """The same config.json written each way checkpoints ship it."""
    hf_written = published.hf_config().to_dict()  # transformers v5 writes `rope_parameters`
    assert "rope_parameters" in hf_written and not hf_written.get("rope_scaling")
    return {
        "rope_scaling.type": published.raw({"type": published.rope_type, **published.rope_scaling}),
        "rope_scaling.rope_type": published.raw({"rope_type": published.rope_type, **published.rope_scaling}),
        "rope_parameters": {**hf_written, "architectures": [published.architecture]},
    }


def reference_rope(published: Published, layer_type: str) -> tuple[torch.Tensor, float]:
    """transformers' inverse frequencies and attention factor for one kind of layer."""
    config = published.hf_config()
    is_nested = isinstance(config.rope_parameters.get(layer_type), dict)
    params = config.rope_parameters[layer_type] if is_nested else config.rope_parameters
    layer = layer_type if is_nested else None
    if params["rope_type"] == "default":
        return Gemma3RotaryEmbedding.compute_default_rope_parameters(config, None, layer_type=layer)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None, layer_type=layer)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_inverse_frequencies_match_transformers_for_published_configs(name: str) -> None:
    published = PUBLISHED[name]
    for spelling, raw in spellings(published).items():
        config = ModelConfig.from_dict(raw)
        for layer, layer_type in enumerate(published.layer_types):
            scaling = config.layer_rope_scaling(layer)
            ours = inverse_frequencies(config.head_dim, config.layer_rope_theta(layer), scaling)
            want, want_factor = reference_rope(published, layer_type)
            where = f"{name}, {spelling}, {layer_type}"
            assert ours.shape == want.shape, where
            assert torch.allclose(ours, want.float(), rtol=1e-6, atol=0.0), where
            assert attention_factor(scaling) == pytest.approx(want_factor, rel=1e-6), where
            expected_type = published.rope_type if layer_type == FULL_ATTENTION else None
            assert (scaling and scaling.rope_type) == expected_type, where


def test_every_spelling_parses_to_the_same_config() -> None:
    for published in PUBLISHED.values():
        parsed = [ModelConfig.from_dict(raw) for raw in spellings(published).values()]
        ropes = {(c.rope_theta, c.rope_scaling, c.layer_rope_thetas, c.layer_rope_scalings) for c in parsed}
        assert len(ropes) == 1, published.architecture


@pytest.mark.parametrize(
    ("extra", "factor"),
    [({"mscale": 0.707, "mscale_all_dim": 0.707}, 1.0), ({"attention_factor": 0.5}, 0.5), ({}, 1.1386294)],
)
def test_yarn_attention_factor_follows_the_config(extra: dict[str, Any], factor: float) -> None:
    raw = PUBLISHED["qwen3-8b-yarn"].raw({"rope_type": "yarn", **QWEN_YARN, **extra})
    assert attention_factor(ModelConfig.from_dict(raw).rope_scaling) == pytest.approx(factor)


def test_cos_sin_at_equals_the_tables_under_yarn() -> None:
    """Gemma 3 computes cos/sin per step (cos_sin_at), Llama reads tables: both carry the attention factor."""
    config = ModelConfig.from_dict(PUBLISHED["qwen2.5-7b-yarn"].raw({"rope_type": "yarn", **QWEN_YARN}))
    scaling = config.rope_scaling
    positions = torch.tensor([0, 1, 4095, 70000])  # [4]
    rope = RotaryEmbedding(config.head_dim, 70001, config.rope_theta, scaling=scaling)
    inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, scaling)  # [head_dim / 2]
    got = cos_sin_at(positions, inv_freq, torch.float32, attention_factor(scaling))
    for ours, table in zip(got, rope.lookup(positions, torch.float32), strict=True):
        assert torch.allclose(ours, table, atol=1e-6)
    assert rope.cos[0].max().item() == pytest.approx(attention_factor(scaling))  # cos(0) * mscale


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "su", "proportional"])
def test_unsupported_rope_types_are_refused_by_name(rope_type: str) -> None:
    published = PUBLISHED["llama-3.1-8b"]
    for raw in (
        published.raw({"type": rope_type, "factor": 2.0}),
        published.raw({"rope_type": rope_type, "factor": 2.0}),
        {
            **published.raw(None),
            "rope_parameters": {"rope_type": rope_type, "rope_theta": 1e4, "factor": 2.0},
        },
    ):
        with pytest.raises(ModelLoadError, match=repr(rope_type)):
            ModelConfig.from_dict(raw)


# -- tiny random models, teacher-forced against transformers -----------------------------------------

NUM_POSITIONS = 256
TOLERANCE = 1e-4
TINY = {**TINY_LLAMA, "max_position_embeddings": NUM_POSITIONS}
# Pretraining lengths scaled down so that the 256 positions reach well past them.
TINY_ROPES: dict[str, tuple[type, type, dict[str, Any]]] = {
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "yarn": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "linear": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            FULL_ATTENTION: {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
            SLIDING_ATTENTION: {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}


def tiny_model(rope: str) -> tuple[Any, dict[str, Any]]:
    """A random transformers model with `rope`'s scaling and the config dict our loader reads."""
    config_class, model_class, rope_parameters = TINY_ROPES[rope]
    settings = {**TINY, "rope_parameters": rope_parameters}
    if rope == "linear":
        settings |= {"head_dim": 32, "sliding_window": 8, "layer_types": [SLIDING_ATTENTION, FULL_ATTENTION]}
    torch.manual_seed(0)
    hf = model_class(config_class(**settings)).eval()
    return hf, {**hf.config.to_dict(), "architectures": [model_class.__name__]}


def without_scaling(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with plain RoPE at the same bases: what we would compute had we ignored the scaling."""
    params = config["rope_parameters"]

    def plain(p: dict[str, Any]) -> dict[str, Any]:
        return {"rope_type": "default", "rope_theta": p["rope_theta"]}

    nested = {k: plain(v) for k, v in params.items() if isinstance(v, dict)}
    return {**config, "rope_parameters": nested or plain(params)}


def engine_logits(loaded: LoadedModel, token_ids: list[int], chunk: int) -> torch.Tensor:
    """Every position's logits, prefilled `chunk` tokens a step into fresh blocks: [len(token_ids), vocab]."""
    block_size = 16
    blocks = list(range(-(-len(token_ids) // block_size)))
    spec = KVCacheSpec.for_model(loaded.config, block_size, loaded.model.kv_dtype)
    caches = allocate_kv_caches(spec, len(blocks), torch.device("cpu"))
    logits = []
    for start in range(0, len(token_ids), chunk):
        num = min(chunk, len(token_ids) - start)
        meta = build_metadata([], [RowSpec(blocks, start, num)], block_size)
        ids = torch.tensor(token_ids[start : start + num])  # [num]
        logits.append(loaded.model.forward(ids, caches, meta, torch.arange(num)))  # [num, vocab]
    return torch.cat(logits)  # [len(token_ids), vocab]


PATHS = [
    ("llama3", "torch", NUM_POSITIONS),
    ("llama3", "auto", 32),  # 32-token steps take the C kernels, which read the rope tables
    ("yarn", "torch", NUM_POSITIONS),
    ("yarn", "auto", 32),
    ("linear", "torch", NUM_POSITIONS),
]


@pytest.mark.parametrize(("rope", "attention", "chunk"), PATHS)
def test_tiny_model_follows_transformers_only_with_the_scaling(rope: str, attention: str, chunk: int) -> None:
    if attention == "auto" and not can_run_cpu_kernels(cpu_flags()):
        pytest.skip("the CPU lacks AVX2/FMA, which the C kernels need")
    hf, config = tiny_model(rope)
    token_ids = torch.randint(
        2, TINY["vocab_size"], (NUM_POSITIONS,), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        want = hf(token_ids[None]).logits[0].float()  # [NUM_POSITIONS, vocab]
    state = hf.state_dict()
    scaled = load_state_dict(config, state, "float32", "scaled", attention=attention)
    plain = load_state_dict(without_scaling(config), state, "float32", "plain", attention=attention)
    if attention == "auto":
        assert getattr(scaled.model, "kernels", None) is not None  # the fused C-kernel path runs
    got = engine_logits(scaled, token_ids.tolist(), chunk)
    unscaled = engine_logits(plain, token_ids.tolist(), chunk)
    assert (got - want).abs().max().item() <= TOLERANCE
    assert (unscaled - want).abs().max().item() > TOLERANCE
