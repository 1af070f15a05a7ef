"""Gemma 3 (text: `Gemma3ForCausalLM`, e.g. gemma-3-270m), written over the paged KV cache.

What differs from Llama (models/llama.py), all following the Hugging Face reference:

- RMSNorm scales by (1 + weight), computed in fp32 and rounded once at the end; the weights are stored
  as that (1 + weight) in fp32 at load time.
- The token embedding is multiplied by sqrt(hidden_size), rounded to the compute dtype.
- Four norms a layer: before and after attention, before and after the MLP; the "after" norms apply to
  the sublayer's output before it joins the residual stream.
- q and k are normalized per head (q_norm, k_norm) before RoPE; scores are scaled by
  query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
- The MLP is gated GELU (tanh approximation) instead of SiLU.
- Layers are local (a sliding window over the last `sliding_window` keys, RoPE base 10k) or global
  (full context, RoPE base 1M, with `rope_scaling` linear factor 8 on the larger checkpoints),
  interleaved as `layer_types` says (5 local, 1 global for 270M).
- `final_logit_softcapping`, when set, squashes logits with cap * tanh(logits / cap). Attention logit
  softcapping (Gemma 2) is refused: SDPA and the C kernel have no hook for it.

One path runs every step: the torch layer below, with the C kernel attending decode rows in place on a
CPU (over an fp32 KV cache, or fp16 under engine.kv_cache_dtype; the kernel takes each layer's window
and scale). The fused C layer kernel does Llama's math only and is not used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.common.errors import CorruptModelError, ModelLoadError
from services.engine.layers.attention import DecodeAttention, kernel_decode_attention
from services.engine.layers.attention_backend import PagedAttention, TorchAttention
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.layers.rope import attention_factor, cos_sin_at, inverse_frequencies, rotate
from services.engine.model_config import ModelConfig
from services.engine.models.llama import check_all_weights_used
from services.engine.ops import arena
from services.engine.ops.build import load_cpu_kernels
from services.engine.ops.cpu import CpuKernels
from services.engine.ops.packed_linear import Linear, make_linear

# Logits of at most this many rows go through the C kernel's matmul, which reads the stored (bf16 or
# fp32) lm_head directly: the 262k-row lm_head is the biggest read of a Gemma decode step.
SMALL_LOGITS_ROWS = 64
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass
class Gemma3Layer:
    input_norm: torch.Tensor  # [hidden], 1 + weight, fp32
    qkv_proj: torch.Tensor  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden]
    qk_norm: torch.Tensor  # [num_heads + num_kv_heads, head_dim], 1 + weight per head, fp32
    o_proj: torch.Tensor  # [hidden, num_heads * head_dim]
    post_attention_norm: torch.Tensor  # [hidden], fp32
    pre_feedforward_norm: torch.Tensor  # [hidden], fp32
    post_feedforward_norm: torch.Tensor  # [hidden], fp32
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor  # [hidden, intermediate]

    MATRICES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True)
class _LayerLinears:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear


class Gemma3Model:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        *,
        use_cpu_kernels: bool = True,
        paged: PagedAttention | None = None,
    ) -> None:
        raw = config.raw or {}
        if raw.get("attn_logit_softcapping") is not None:
            raise ModelLoadError("Gemma attention logit softcapping is not supported")
        if raw.get("use_bidirectional_attention"):
            raise ModelLoadError("Gemma 3 with bidirectional attention is not a causal LM")
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or GELU_TANH[0]
        if activation not in GELU_TANH:
            raise ModelLoadError(f"Gemma 3 activation {activation!r} is not supported")
        self.config = config
        self.paged: PagedAttention = paged or TorchAttention()
        self.dtype = dtype
        cap = raw.get("final_logit_softcapping")
        self.final_logit_softcapping: float | None = None if cap is None else float(cap)
        self.scale = float(raw.get("query_pre_attn_scalar") or config.head_dim) ** -0.5
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim

        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise CorruptModelError(f"weight {name!r} is missing from the safetensors files")
            used.add(name)
            return weights[name].contiguous()

        embed = take("model.embed_tokens.weight")  # [vocab, hidden], stored dtype
        self.stored_dtype = embed.dtype
        self.norm = _norm_scale(take("model.norm.weight"))  # [hidden]
        is_tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        lm_head = embed if is_tied else take("lm_head.weight")  # [vocab, hidden]
        layers = [self._load_layer(take, i) for i in range(config.num_layers)]
        check_all_weights_used(type(self).__name__, weights, used | {"lm_head.weight"})

        # The matrices a decode step streams, in one huge-page buffer (ops/arena.py), as stored.
        names = Gemma3Layer.MATRICES
        packed = arena.pack([getattr(layer, n) for layer in layers for n in names] + [lm_head])
        self.stored_layers = [
            dataclasses.replace(layer, **dict(zip(names, packed[4 * i : 4 * i + 4], strict=True)))
            for i, layer in enumerate(layers)
        ]
        self.lm_head_stored = packed[-1]  # [vocab, hidden]
        self.embed_tokens = self.lm_head_stored if is_tied else embed  # [vocab, hidden]
        # Compute-dtype copies of the matrices (none where the stored dtype is the compute dtype).
        self.layers = [
            dataclasses.replace(layer, **{n: getattr(layer, n).to(dtype) for n in names})
            for layer in self.stored_layers
        ]
        self.linears = [_LayerLinears(*(make_linear(getattr(t, n)) for n in names)) for t in self.layers]
        self.lm_head = self.lm_head_stored.to(dtype)  # [vocab, hidden]
        self.lm_head_linear = make_linear(self.lm_head)
        self.device = embed.device
        embed_scale = torch.tensor(config.hidden_size**0.5).to(dtype)  # rounded as the reference does
        self.embed_scale = embed_scale.to(self.device)
        # Each layer's RoPE (base, scaling): local and global layers differ in both on the larger checkpoints.
        self.layer_ropes = [
            (config.layer_rope_theta(i), config.layer_rope_scaling(i)) for i in range(config.num_layers)
        ]
        self.inv_freqs = {
            rope: inverse_frequencies(config.head_dim, *rope).to(self.device)
            for rope in set(self.layer_ropes)
        }  # [head_dim / 2] per (base, scaling)

        on_cpu = self.device.type == "cpu"  # the C kernels read host memory; a GPU takes the torch path
        kernels = load_cpu_kernels() if use_cpu_kernels and on_cpu and self._attention_kernel_fits() else None
        # Decode rows read the cache in place through the C kernel: fp32 KV unless engine.kv_cache_dtype
        # says fp16 (loader.resolve_kv_dtype).
        self.attention_kernels: CpuKernels | None = kernels
        self.kv_dtype = torch.float32 if kernels is not None else dtype
        formats = dtype == torch.float32 and self.stored_dtype in (torch.float32, torch.bfloat16)
        self.logits_kernels = kernels if formats and config.hidden_size % 8 == 0 else None

    def _load_layer(self, take: Callable[[str], torch.Tensor], i: int) -> Gemma3Layer:
        cfg = self.config
        p = f"model.layers.{i}."
        qkv = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")])
        q_norm = take(p + "self_attn.q_norm.weight").expand(cfg.num_heads, -1)  # [num_heads, head_dim]
        k_norm = take(p + "self_attn.k_norm.weight").expand(cfg.num_kv_heads, -1)  # [kv_heads, head_dim]
        return Gemma3Layer(
            input_norm=_norm_scale(take(p + "input_layernorm.weight")),
            qkv_proj=qkv.contiguous(),
            qk_norm=_norm_scale(torch.cat([q_norm, k_norm])),  # [num_heads + num_kv_heads, head_dim]
            o_proj=take(p + "self_attn.o_proj.weight"),
            post_attention_norm=_norm_scale(take(p + "post_attention_layernorm.weight")),
            pre_feedforward_norm=_norm_scale(take(p + "pre_feedforward_layernorm.weight")),
            post_feedforward_norm=_norm_scale(take(p + "post_feedforward_layernorm.weight")),
            gate_up_proj=torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            down_proj=take(p + "mlp.down_proj.weight"),
        )

    def _attention_kernel_fits(self) -> bool:
        cfg = self.config
        return cfg.num_heads % cfg.num_kv_heads == 0 and cfg.head_dim % 8 == 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of every distinct weight tensor held: stored weights plus compute-dtype copies."""
        tensors = [self.embed_tokens, self.lm_head_stored, self.lm_head, self.norm]
        for layer in (*self.stored_layers, *self.layers):
            tensors += list(vars(layer).values())
        unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
        return sum(unique.values())

    def _rms_norm(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Gemma3RMSNorm: normalize and scale by (1 + weight) in fp32, then round to x's dtype once."""
        xf = x.float()  # [..., dim]
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return (xf * scale).to(x.dtype)  # [..., dim]

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """token_ids: [num_tokens]; returns float32 logits [len(logits_indices), vocab]."""
        h = F.embedding(token_ids, self.embed_tokens).to(self.dtype) * self.embed_scale  # [tokens, hidden]
        cos_sin = {
            rope: cos_sin_at(meta.positions, inv_freq, self.dtype, attention_factor(rope[1]))
            for rope, inv_freq in self.inv_freqs.items()
        }
        decode_attention = kernel_decode_attention(self.attention_kernels, meta, self.scale)
        for i, cache in enumerate(kv_caches):
            h = self._layer(i, h, cache, meta, cos_sin[self.layer_ropes[i]], decode_attention)
        x = self._rms_norm(h[logits_indices], self.norm)  # [num_samples, hidden]
        kernels = self.logits_kernels
        if kernels is not None and x.shape[0] <= SMALL_LOGITS_ROWS:
            logits = x.new_empty(x.shape[0], self.lm_head_stored.shape[0])  # [num_samples, vocab]
            kernels.linear(x, self.lm_head_stored, logits)
        else:
            logits = self.lm_head_linear(x).float()  # [num_samples, vocab]
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _layer(
        self,
        i: int,
        h: torch.Tensor,
        cache: torch.Tensor,
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        decode_attention: DecodeAttention | None,
    ) -> torch.Tensor:
        cfg = self.config
        layer, linears = self.layers[i], self.linears[i]
        num_tokens = h.shape[0]
        heads, kv_heads, qk_size = cfg.num_heads, cfg.num_kv_heads, self.q_size + self.kv_size
        x = self._rms_norm(h, layer.input_norm)  # [num_tokens, hidden]
        qkv = linears.qkv(x)  # [num_tokens, q_size + 2 * kv_size]
        qk = qkv[:, :qk_size].view(num_tokens, heads + kv_heads, -1)  # [num_tokens, heads + kv_heads, hd]
        qk = self._rms_norm(qk, layer.qk_norm)  # every head normalized over head_dim
        q, k = rotate(qk, cos_sin).split([heads, kv_heads], dim=1)  # q and k rotated at once
        v = qkv[:, qk_size:].view(num_tokens, kv_heads, -1)  # [num_tokens, kv_heads, head_dim]
        self.paged.store(cache, meta, k, v)
        attn = self.paged.attend(
            q, k, v, cache, meta, decode_attention, window=cfg.window(i), scale=self.scale
        )  # [num_tokens, heads, head_dim]
        attn_out = linears.o(attn.reshape(num_tokens, self.q_size))  # [num_tokens, hidden]
        h = h + self._rms_norm(attn_out, layer.post_attention_norm)  # [num_tokens, hidden]
        x = self._rms_norm(h, layer.pre_feedforward_norm)  # [num_tokens, hidden]
        gate, up = linears.gate_up(x).chunk(2, dim=-1)  # [num_tokens, intermediate] each
        mlp_out = linears.down(F.gelu(gate, approximate="tanh") * up)  # [num_tokens, hidden]
        return h + self._rms_norm(mlp_out, layer.post_feedforward_norm)  # [num_tokens, hidden]


def _norm_scale(weight: torch.Tensor) -> torch.Tensor:
    """Gemma stores RMSNorm weights centred on 0; the norm multiplies by 1 + weight, in fp32."""
    return 1.0 + weight.float()
