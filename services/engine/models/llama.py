"""The Llama family (SmolLM2, Llama 2/3 without RoPE scaling), written over the paged KV cache.

Reads top to bottom: weights, then one decoder layer, then the whole forward. Q/K/V and gate/up
projections are fused into one matmul each at load time; the math is the Hugging Face reference's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.common.errors import CorruptModelError
from services.engine.attention import AttentionMetadata, paged_attention, write_kv
from services.engine.models.config import ModelConfig
from services.engine.rope import RotaryEmbedding


@dataclass
class LlamaLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.config = config
        self.dtype = dtype

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise CorruptModelError(f"weight {name!r} is missing from the safetensors files")
            return weights[name].to(dtype).contiguous()

        self.embed_tokens = take("model.embed_tokens.weight")  # [vocab, hidden]
        self.norm = take("model.norm.weight")  # [hidden]
        lm_head = weights.get("lm_head.weight")
        use_embed = config.tie_word_embeddings or lm_head is None
        self.lm_head = self.embed_tokens if use_embed else take("lm_head.weight")  # [vocab, hidden]
        self.layers = [self._load_layer(take, weights, i) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

    def _load_layer(self, take, weights: Mapping[str, torch.Tensor], i: int) -> LlamaLayer:
        p = f"model.layers.{i}."
        qkv = [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
        bias = None
        if self.config.attention_bias:
            bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")])
        return LlamaLayer(
            input_norm=take(p + "input_layernorm.weight"),
            qkv_proj=torch.cat(qkv).contiguous(),
            qkv_bias=bias,
            o_proj=take(p + "self_attn.o_proj.weight"),
            post_norm=take(p + "post_attention_layernorm.weight"),
            gate_up_proj=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            down_proj=take(p + "mlp.down_proj.weight"),
        )

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_norm_eps)

    def _layer(
        self, layer: LlamaLayer, h: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, cos_sin
    ) -> torch.Tensor:
        cfg = self.config
        num_tokens = h.shape[0]
        x = self._rms_norm(h, layer.input_norm)  # [num_tokens, hidden]
        qkv = F.linear(x, layer.qkv_proj, layer.qkv_bias)  # [num_tokens, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, cfg.num_heads, cfg.head_dim)  # [num_tokens, num_heads, head_dim]
        k = k.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [num_tokens, kv_heads, head_dim]
        v = v.view(num_tokens, cfg.num_kv_heads, cfg.head_dim)  # [num_tokens, kv_heads, head_dim]
        q, k = self.rope.apply(q, k, cos_sin)
        write_kv(cache, meta.slot_mapping, k, v)
        attn = paged_attention(q, cache, meta)  # [num_tokens, num_heads, head_dim]
        h = h + F.linear(attn.view(num_tokens, self.q_size), layer.o_proj)
        x = self._rms_norm(h, layer.post_norm)
        gate, up = F.linear(x, layer.gate_up_proj).chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return h + F.linear(F.silu(gate) * up, layer.down_proj)  # [num_tokens, hidden]

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """token_ids: [num_tokens]; returns float32 logits [len(logits_indices), vocab]."""
        h = F.embedding(token_ids, self.embed_tokens)  # [num_tokens, hidden]
        cos_sin = self.rope.lookup(meta.positions, self.dtype)
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            h = self._layer(layer, h, cache, meta, cos_sin)
        h = self._rms_norm(h[logits_indices], self.norm)  # [num_samples, hidden]
        return F.linear(h, self.lm_head).float()  # [num_samples, vocab]
