"""T5's decoder over the engine's paged KV cache, many sequences in one step (issue 51).

A step is laid out as for decoder-only models (layers/attention_metadata.py): decode rows, then prefill
chunks, each row with its block table. Two kinds of blocks hold a row's KV, both in the one cache tensor
per decoder layer:

- self-attention keys and values, in the row's blocks as the step writes them (`meta.slot_mapping`);
- cross-attention keys and values, in blocks of their own (`CrossRow`): written once from the row's
  encoder output (`write_cross_kv`), read by every later step, outside the prefix cache, freed with the
  request. A token of cross KV takes what a token of self KV takes, so the pool's blocks serve both and the
  KV budget counts both.

Attention runs in torch, row by row (T5's additive relative position bias is in no kernel): each row's
context is gathered through its block table. The relative bias is computed once per step and row from the
positions, and shared by every layer, as in the model (t5.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine.layers.attention import write_kv
from services.engine.layers.attention_backend import PagedAttention, TorchAttention
from services.engine.layers.attention_metadata import AttentionMetadata, slots_of, to_device
from services.engine.model_config import ModelConfig
from services.engine.models.t5 import T5Config, T5Model


@dataclass(frozen=True)
class CrossRow:
    """A row's cross-attention KV: the blocks that hold it and its source's length in tokens."""

    block_ids: Sequence[int]
    num_tokens: int


@dataclass(frozen=True)
class _Row:
    first: int  # the row's first token in the step's flat layout
    num_new: int
    self_slots: torch.Tensor  # [context] cache slots of the row's self-attention context
    bias: torch.Tensor  # [heads, num_new, context]: relative position bias, -inf past each query
    cross_slots: torch.Tensor  # [source] cache slots of the row's cross KV


@torch.inference_mode()
def write_cross_kv(
    model: T5Model,
    encoder_output: torch.Tensor,
    row: CrossRow,
    kv_caches: list[torch.Tensor],
    block_size: int,
) -> None:
    """Every decoder layer's cross-attention keys and values of one encoder output [S, d_model] into the
    row's cross blocks."""
    slots = to_device(slots_of(row.block_ids, 0, row.num_tokens, block_size), encoder_output.device)
    heads, d_kv = model.config.num_heads, model.config.d_kv
    for layer, cache in zip(model.decoder, kv_caches, strict=True):
        attn = layer.cross_attn
        assert attn is not None
        k = (encoder_output @ attn.k.T).view(-1, heads, d_kv)
        v = (encoder_output @ attn.v.T).view(-1, heads, d_kv)
        write_kv(cache, slots, k, v)


@torch.inference_mode()
def forward(
    model: T5Model,
    token_ids: torch.Tensor,
    kv_caches: list[torch.Tensor],
    meta: AttentionMetadata,
    logits_indices: torch.Tensor,
    cross: Sequence[CrossRow],
) -> torch.Tensor:
    """The step's decoder tokens [num_tokens] through every decoder layer, their self KV written to the
    cache; fp32 logits [len(logits_indices), vocab]. `cross`: each row's cross KV, in the rows' order."""
    rows = _rows(model, meta, cross)
    heads, d_kv = model.config.num_heads, model.config.d_kv
    h = F.embedding(token_ids, model.embed)  # [num_tokens, d_model]
    for layer, cache in zip(model.decoder, kv_caches, strict=True):
        a, c = layer.self_attn, layer.cross_attn
        assert c is not None and layer.cross_norm is not None
        x = model.norm(h, layer.self_norm)
        q, k, v = ((x @ w.T).view(-1, heads, d_kv) for w in (a.q, a.k, a.v))
        write_kv(cache, meta.slot_mapping, k, v)
        h = h + _attend_rows(model, a.o, q, cache, rows, cross=False)
        q = (model.norm(h, layer.cross_norm) @ c.q.T).view(-1, heads, d_kv)
        h = h + _attend_rows(model, c.o, q, cache, rows, cross=True)
        h = h + model.feed_forward(layer.ff, model.norm(h, layer.ff_norm))
    h = model.norm(h[logits_indices], model.decoder_norm)
    if model.config.scale_decoder_output:
        h = h * model.config.d_model**-0.5
    return (h @ model.lm_head.T).float()


def _rows(model: T5Model, meta: AttentionMetadata, cross: Sequence[CrossRow]) -> list[_Row]:
    specs = (*meta.decode_rows, *meta.prefill_rows)
    if not cross:  # a warm-up step (memory planning on a GPU) runs decoder rows without sources
        cross = [CrossRow((), 0)] * len(specs)
    if len(cross) != len(specs):
        raise ValueError(f"{len(specs)} rows in the step but cross KV for {len(cross)}")
    rows, first, device = [], 0, meta.device
    for spec, row_cross in zip(specs, cross, strict=True):
        context = spec.context_len
        queries = torch.arange(spec.start_position, context, device=device)
        keys = torch.arange(context, device=device)
        bias = model.position_bias(model.decoder_bias, queries, keys, bidirectional=False)
        self_slots = slots_of(spec.block_ids, 0, context, meta.block_size)
        cross_slots = slots_of(row_cross.block_ids, 0, row_cross.num_tokens, meta.block_size)
        self_tensor, cross_tensor = to_device(self_slots, device), to_device(cross_slots, device)
        rows.append(_Row(first, spec.num_new_tokens, self_tensor, bias, cross_tensor))
        first += spec.num_new_tokens
    return rows


def _attend_rows(
    model: T5Model, o: torch.Tensor, q: torch.Tensor, cache: torch.Tensor, rows: list[_Row], *, cross: bool
) -> torch.Tensor:
    """Each row's queries over its context (self, with the bias) or its source (cross, no bias), through
    the output projection: [num_tokens, d_model]."""
    out = torch.empty(q.shape[0], model.config.inner_dim, dtype=q.dtype, device=q.device)
    for row in rows:
        kv = cache[row.cross_slots if cross else row.self_slots].to(q.dtype)  # [ctx, 2, heads, d_kv]
        k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [heads, ctx, d_kv]
        q_row = q[row.first : row.first + row.num_new].transpose(0, 1)  # [heads, new, d_kv]
        scores = q_row.float() @ k.float().transpose(1, 2)  # [heads, new, ctx]: unscaled
        if not cross:
            scores = scores + row.bias
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out[row.first : row.first + row.num_new] = (probs @ v).transpose(0, 1).reshape(row.num_new, -1)
    return out @ o.T


class T5ForEngine:
    """The T5 family as the engine runs it (registry.py): the decoder over the paged cache, each new
    sequence's encoder pass written into its cross blocks first (`encode_into`). Torch attention on every
    device; the C and Triton kernels take no additive bias."""

    is_encoder_decoder = True

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        *,
        use_cpu_kernels: bool = False,
        paged: PagedAttention | None = None,
    ) -> None:
        self.config = config
        self.t5 = T5Model(T5Config.from_dict(config.raw or {}), weights, dtype)
        self.dtype = self.kv_dtype = dtype
        self.device = self.t5.device
        self.paged: PagedAttention = TorchAttention()  # whatever was chosen: the bias needs torch

    @torch.inference_mode()
    def encode_into(
        self,
        sources: Sequence[Sequence[int]],
        cross: Sequence[CrossRow],
        kv_caches: list[torch.Tensor],
        block_size: int,
    ) -> list[torch.Tensor]:
        """The sources' encoder pass, batched, each output's cross KV into its row's cross blocks; the
        encoder outputs [S, d_model], for a prefill replica to ship."""
        outputs = self.t5.encode_batch([to_device(list(source), self.device) for source in sources])
        for output, row in zip(outputs, cross, strict=True):
            write_cross_kv(self.t5, output, row, kv_caches, block_size)
        return list(outputs)

    def write_cross(
        self, encoder_output: torch.Tensor, row: CrossRow, kv_caches: list[torch.Tensor], block_size: int
    ) -> None:
        """A shipped encoder output's cross KV into the row's cross blocks (a decode replica's)."""
        write_cross_kv(self.t5, encoder_output, row, kv_caches, block_size)

    def forward(
        self,
        token_ids: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,
        cross: Sequence[CrossRow] = (),
    ) -> torch.Tensor:
        return forward(self.t5, token_ids, kv_caches, meta, logits_indices, cross)
