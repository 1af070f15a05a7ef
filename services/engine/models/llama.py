"""The Llama family (SmolLM2, Llama 2, Llama 3.x with its RoPE scaling), written over the paged KV cache.

Reads top to bottom: weights, one decoder layer in torch, the two forward paths. Q/K/V and gate/up
projections are fused into one matmul each at load time; the math is the Hugging Face reference's.
Qwen2 and Qwen3 (models/qwen.py) reuse this file: q/k/v biases, per-head q/k norms and sliding windows
are options here, and any option the C kernels lack (q/k norms, windows) keeps a model on the torch path.

Weights are kept in the dtype the loader hands them over in; activations, the KV cache and every sum are
in `dtype`. Two paths run the same math:

- small steps (at most `small_step_max_tokens` tokens: decode batches, short chunks) run every layer in
  one call into the C kernels of `services/engine/ops` when `dtype` is float32. They read the weights as
  stored (bf16 weights: half the bytes of fp32, the cost of a decode step) and accumulate in fp32. Each
  token's numbers are computed the same way whatever else is in the step.
- other steps (prefill chunks) take `_torch_layer`: MKL/oneDNN matmuls and SDPA in `dtype`. With bf16
  weights and fp32 compute they multiply an fp32 copy of the same bf16 values, so both paths use one set
  of weights and differ only in fp32 rounding order.

Weights may also come as GGUF blocks (`QuantizedWeight`, Q8_0 or Q4_1: loading/gguf_weights.py), kept as
stored (each row's bytes regrouped at load, quant.split): the C kernels multiply by them directly
(ops/fused_layers.py holds the layers as they read them), the torch path unpacks one matrix at a time into a
reused fp32 buffer (ops/block_linear.py `BlockLinear`; bf16 with int8 activations on a CPU with bf16 in
hardware, for oneDNN's bf16 GEMM), and embeddings are unpacked per looked-up row. That needs the C kernels and
fp32 compute. With `unpacked_dtype` (model.weights gguf-hybrid) every block matrix is also unpacked once, at
load, into that dtype (prepacked for oneDNN when bf16), and the torch path multiplies by that copy
(`UnpackedLinear`): no per-step unpacking, at the cost of a second copy of the weights in memory. Either way a
token's rounding depends on the size of the step it is computed in (int8 activations and blocks below the
threshold, a GEMM above it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.common.errors import CorruptModelError, ModelLoadError
from services.engine.layers.attention import DecodeAttention, kernel_decode_attention
from services.engine.layers.attention_backend import PagedAttention, TorchAttention
from services.engine.layers.attention_metadata import AttentionMetadata
from services.engine.layers.rope import RotaryEmbedding
from services.engine.model_config import ModelConfig
from services.engine.ops.block_linear import BlockLinears, cat_weight_rows, to_dtype, weight_data
from services.engine.ops.build import load_cpu_kernels
from services.engine.ops.cpu import CpuKernels, LlamaDims, kv_f16
from services.engine.ops.fused_layers import (
    FusedLayerPointers,
    LlamaLayer,
    one_format,
    pack_streamed_weights,
    projections,
)
from services.engine.ops.packed_linear import Linear, make_linear
from services.engine.ops.quant import (
    INT8_ACTIVATIONS,
    QuantizedWeight,
    Weight,
    WeightFormat,
)

# Steps up to this many tokens take the C kernels: on an AVX2 Zen 3 they beat MKL's fp32 GEMM up to
# M = 64 to 96 tokens (docs/performance.md), so decode batches up to 64 stay on them.
SMALL_STEP_MAX_TOKENS = 64
# The two paths a step's layers take, as counted in LlamaModel.num_steps_by_path: every layer in one call
# into the C kernels (small steps), or torch's GEMMs and attention one op at a time (large steps).
STEP_PATHS = ("kernels", "gemm")
# ...unless their prefill rows attend over long contexts: the kernel attends query by query and rereads
# the context per query, where SDPA works in tiles (a 64-token chunk at position 4000: 40 ms a layer
# against 12 ms). Decode rows always stay on the kernel: it beats a padded gather plus SDPA 5 to 6 times.
SMALL_STEP_MAX_PREFILL_KEY_READS = 16384


@dataclass(frozen=True)
class _LayerLinears:
    """A layer's four matmuls in the compute dtype (prepacked for oneDNN where that helps)."""

    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear

    @classmethod
    def of(
        cls, layer: LlamaLayer, blocks: Callable[[QuantizedWeight, torch.Tensor | None], Linear]
    ) -> _LayerLinears:
        """`blocks` makes the matmul of a matrix kept as GGUF blocks."""

        def linear(weight: Weight, bias: torch.Tensor | None = None) -> Linear:
            return blocks(weight, bias) if isinstance(weight, QuantizedWeight) else make_linear(weight, bias)

        return cls(
            linear(layer.qkv_proj, layer.qkv_bias),
            linear(layer.o_proj),
            linear(layer.gate_up_proj),
            linear(layer.down_proj),
        )


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        *,
        use_cpu_kernels: bool = True,
        paged: PagedAttention | None = None,
        small_step_max_tokens: int = SMALL_STEP_MAX_TOKENS,
        int8_activations: bool = False,
        unpacked_dtype: torch.dtype | None = None,
    ) -> None:
        """`int8_activations`: with GGUF blocks, the kernel path quantizes activations to int8 per 32-block
        for integer dot products (llama.cpp's way: faster, a little less exact); the torch path stays fp32.
        `unpacked_dtype`: with GGUF blocks, the torch path's matmuls read a copy of every block matrix
        unpacked at load into this dtype (float32 or bfloat16) instead of unpacking per step."""
        self.config = config
        self.int8_activations = int8_activations
        self.unpacked_dtype = unpacked_dtype
        self.num_steps_by_path = {path: 0 for path in STEP_PATHS}  # steps each path ran, counted in forward
        self.paged: PagedAttention = paged or TorchAttention()
        self.dtype = dtype
        self.small_step_max_tokens = small_step_max_tokens
        # engine.deterministic (loading/deterministic.py): every step on the C kernels, whatever its size
        self.deterministic = False

        used: set[str] = set()

        def take(name: str) -> Weight:
            if name not in weights:
                raise CorruptModelError(f"weight {name!r} is missing from the model's weights")
            used.add(name)
            weight = weights[name]
            return weight if isinstance(weight, QuantizedWeight) else weight.contiguous()

        def take_tensor(name: str) -> torch.Tensor:
            weight = take(name)
            if isinstance(weight, QuantizedWeight):
                raise ModelLoadError(f"{name} must be a float tensor, not {weight.format.name} blocks")
            return weight

        embed = take("model.embed_tokens.weight")  # [vocab, hidden], as stored
        self.norm = take_tensor("model.norm.weight").to(dtype)  # [hidden]
        is_tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        layers = [self._load_layer(take, take_tensor, i) for i in range(config.num_layers)]
        lm_head = embed if is_tied else take("lm_head.weight")  # [vocab, hidden]
        check_all_weights_used(type(self).__name__, weights, used | {"lm_head.weight"})
        self.stored_layers, self.lm_head_stored = pack_streamed_weights(layers, lm_head)
        self.weight_format = one_format(self.stored_layers)
        self.embed_tokens = self.lm_head_stored if is_tied else embed  # [vocab, hidden]
        self.device = self.norm.device
        on_cpu = self.device.type == "cpu"  # the C kernels read host memory; a GPU takes the torch path
        kernels = load_cpu_kernels() if use_cpu_kernels and on_cpu and self._attention_kernel_fits() else None
        self._check_blocks_can_run(kernels)
        self.lm_head = to_dtype(self.lm_head_stored, dtype)  # [vocab, hidden]
        self.layers = [layer.to(dtype) for layer in self.stored_layers]
        self.rope = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            self.device,
            config.rope_scaling,
        )
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        matrices = [w for layer in self.stored_layers for w in projections(layer)] + [self.lm_head_stored]
        blocks = (
            BlockLinears(kernels, matrices, unpacked_dtype=unpacked_dtype, int8_activations=int8_activations)
            if kernels is not None
            else _no_blocks
        )
        self.linears = [_LayerLinears.of(layer, blocks) for layer in self.layers]
        self.lm_head_linear = (
            blocks(self.lm_head, None)
            if isinstance(self.lm_head, QuantizedWeight)
            else make_linear(self.lm_head)
        )
        # bytes of the load-time unpacked copies (unpacked_dtype)
        self.unpacked_bytes = blocks.unpacked_bytes if isinstance(blocks, BlockLinears) else 0
        self.kernels = kernels if self._kernels_fit() else None  # every layer in one call (fp32 only)
        # Decode rows read the cache in place through the C kernel, which reads fp32 or fp16 KV: under
        # bf16 compute the cache is kept in fp32 (bf16 K/V are stored exactly; twice the bytes), unless
        # engine.kv_cache_dtype says otherwise (loader.resolve_kv_dtype).
        self.attention_kernels = kernels
        self.kv_dtype = torch.float32 if kernels is not None else dtype
        self.fused_pointers = FusedLayerPointers(self.stored_layers)

    def _load_layer(
        self, take: Callable[[str], Weight], take_tensor: Callable[[str], torch.Tensor], i: int
    ) -> LlamaLayer:
        p = f"model.layers.{i}."
        qkv = [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
        bias = None
        if self.config.attention_bias:
            bias = torch.cat([take_tensor(p + f"self_attn.{n}_proj.bias") for n in ("q", "k", "v")])
        return LlamaLayer(
            input_norm=take_tensor(p + "input_layernorm.weight"),
            qkv_proj=cat_weight_rows(qkv),
            qkv_bias=bias,
            o_proj=take(p + "self_attn.o_proj.weight"),
            post_norm=take_tensor(p + "post_attention_layernorm.weight"),
            gate_up_proj=cat_weight_rows([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]),
            down_proj=take(p + "mlp.down_proj.weight"),
        )

    def _check_blocks_can_run(self, kernels: CpuKernels | None) -> None:
        """GGUF blocks run only through the C kernels, in fp32."""
        if not isinstance(self.lm_head_stored, QuantizedWeight) and self.weight_format in (
            WeightFormat.F32,
            WeightFormat.BF16,
        ):
            if self.int8_activations or self.unpacked_dtype is not None:
                raise ModelLoadError(
                    "int8 activations and load-time unpacking need GGUF-quantized weights "
                    "(model.weights gguf-int8 or gguf-hybrid)"
                )
            return
        if kernels is None or self.dtype != torch.float32:
            raise ModelLoadError(
                "GGUF-quantized weights need the CPU kernels (an x86 CPU with AVX2, FMA and F16C, "
                "engine.device cpu, attention auto) and model.dtype float32 or auto"
            )

    def _kernels_fit(self) -> bool:
        """kr_llama_layers does Llama's math only: no q/k norms, no sliding windows."""
        cfg = self.config
        sizes = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim, self.q_size)
        formats = self.dtype == torch.float32 and self.weight_format is not None  # blocks: K % 32 == 0
        plain = not cfg.has_sliding_windows and all(layer.qk_norm is None for layer in self.layers)
        return plain and formats and self._attention_kernel_fits() and all(size % 8 == 0 for size in sizes)

    def _attention_kernel_fits(self) -> bool:
        cfg = self.config
        return cfg.num_heads % cfg.num_kv_heads == 0 and cfg.head_dim % 8 == 0

    @property
    def weight_bytes(self) -> int:
        """Bytes of every distinct weight tensor held: stored weights plus compute-dtype copies."""
        weights = [self.embed_tokens, self.lm_head_stored, self.lm_head, self.norm]
        for layer in (*self.stored_layers, *self.layers):
            weights += [w for w in vars(layer).values() if w is not None]
        tensors = [weight_data(w) for w in weights]
        unique = {t.data_ptr(): t.numel() * t.element_size() for t in tensors}
        return sum(unique.values()) + self.unpacked_bytes

    @torch.inference_mode()
    def forward(
        self,
        token_ids: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """token_ids: [num_tokens]; returns float32 logits [len(logits_indices), vocab]."""
        kernels = self.kernels
        is_small = (
            meta.num_tokens <= self.small_step_max_tokens
            and meta.num_prefill_key_reads <= SMALL_STEP_MAX_PREFILL_KEY_READS
        )
        if kernels is not None and (is_small or self.deterministic):
            self.num_steps_by_path["kernels"] += 1
            h = self._kernel_forward(kernels, token_ids, kv_caches, meta)  # [num_tokens, hidden]
        else:
            self.num_steps_by_path["gemm"] += 1
            h = self._torch_forward(token_ids, kv_caches, meta)  # [num_tokens, hidden]
        h = h[logits_indices]  # [num_samples, hidden]
        if kernels is None or (h.shape[0] > self.small_step_max_tokens and not self.deterministic):
            return self.lm_head_linear(self._rms_norm(h, self.norm)).float()  # [num_samples, vocab]
        x = torch.empty_like(h)  # [num_samples, hidden]
        kernels.rms_norm(h, self.norm, x, self.config.rms_norm_eps)
        logits = h.new_empty(h.shape[0], self.lm_head_stored.shape[0])  # [num_samples, vocab]
        kernels.linear(x, self.lm_head_stored, logits, int8_activations=self._int8_lm_head)
        return logits

    # -- the torch path -----------------------------------------------------------------------------

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Hugging Face's LlamaRMSNorm op for op: normalize in fp32, round to x's dtype, then scale. In bf16
        this rounding order decides near-ties (F.rms_norm's single rounding flipped "The capital..." to
        "L'Étoile..." on the chat prompt "What is the capital of France?"), so we keep the reference's."""
        xf = x.float()  # [num_tokens, hidden]
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * xf.to(x.dtype)  # [num_tokens, hidden]

    def _torch_layer(
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
        x = self._rms_norm(h, layer.input_norm)  # [num_tokens, hidden]
        qkv = linears.qkv(x)  # [num_tokens, q_size + 2 * kv_size]
        heads, kv_heads, qk_size = cfg.num_heads, cfg.num_kv_heads, self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(num_tokens, heads + kv_heads, -1)  # [num_tokens, heads + kv_heads, hd]
        if layer.qk_norm is not None:
            qk = self._rms_norm(qk, layer.qk_norm)  # each head normalized over head_dim
        q, k = self.rope.rotate(qk, cos_sin).split([heads, kv_heads], dim=1)  # q and k rotated at once
        v = qkv[:, qk_size:].view(num_tokens, kv_heads, -1)  # [num_tokens, kv_heads, head_dim]
        self.paged.store(cache, meta, k, v)
        attn = self.paged.attend(
            q, k, v, cache, meta, decode_attention, window=cfg.window(i)
        )  # [num_tokens, heads, head_dim]
        h = h + linears.o(attn.reshape(num_tokens, self.q_size))  # [num_tokens, hidden]
        x = self._rms_norm(h, layer.post_norm)  # [num_tokens, hidden]
        gate, up = linears.gate_up(x).chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return h + linears.down(F.silu(gate) * up)  # [num_tokens, hidden]

    @property
    def _int8_lm_head(self) -> bool:
        return self.int8_activations and isinstance(self.lm_head_stored, QuantizedWeight)

    def _embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of token_ids [num_tokens]: [num_tokens, hidden] (GGUF blocks unpacked)."""
        if isinstance(self.embed_tokens, QuantizedWeight):
            return self.embed_tokens.rows(token_ids).dequantize()
        return F.embedding(token_ids, self.embed_tokens)

    def _torch_forward(
        self, token_ids: torch.Tensor, kv_caches: list[torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        h = self._embed(token_ids).to(self.dtype)  # [num_tokens, hidden]
        cos_sin = self.rope.lookup(meta.positions, self.dtype)
        decode_attention = kernel_decode_attention(self.attention_kernels, meta)
        for i, cache in enumerate(kv_caches):
            h = self._torch_layer(i, h, cache, meta, cos_sin, decode_attention)
        return h

    # -- the kernel path ----------------------------------------------------------------------------

    def _kernel_forward(
        self,
        kernels: CpuKernels,
        token_ids: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        h = self._embed(token_ids).float()  # [num_tokens, hidden]
        kernels.llama_layers(
            self._dims(meta.block_size, kv_caches[0].dtype),
            self.fused_pointers.for_caches(kv_caches),
            h,
            meta.positions,
            meta.slot_mapping,
            meta.block_tables,
            meta.token_rows,
        )
        return h

    def _dims(self, block_size: int, kv_dtype: torch.dtype) -> LlamaDims:
        cfg = self.config
        weight_code = int(self.weight_format or 0) | (INT8_ACTIVATIONS if self.int8_activations else 0)
        return LlamaDims(
            cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            block_size, cfg.rms_norm_eps, weight_code, kv_f16(kv_dtype),
            self.rope.cos.data_ptr(), self.rope.sin.data_ptr(),
        )  # fmt: skip


def check_all_weights_used(family: str, weights: Mapping[str, torch.Tensor], used: set[str]) -> None:
    """Refuse weights the family would silently ignore (an o_proj bias, an unknown norm): wrong math."""
    unused = sorted(name for name in weights if name not in used and not name.endswith("rotary_emb.inv_freq"))
    if unused:
        shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
        raise ModelLoadError(f"{family} does not use these weights: {shown}")


def _no_blocks(weight: QuantizedWeight, bias: torch.Tensor | None) -> Linear:
    raise AssertionError("GGUF blocks without the C kernels (_check_blocks_can_run refuses them)")
