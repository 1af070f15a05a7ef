"""The T5 family (T5, T5 v1.1, Flan-T5): an encoder that reads the source once, a decoder that loops.

Reads top to bottom: the config, the relative position buckets, the weights, the encoder, the decoder.
The math is the Hugging Face reference's, written over our own tensors:

- attention scores are q·k with no 1/sqrt(d) scaling, plus a relative position bias computed once per stack
  from the first layer's table and shared by every layer: bidirectional buckets in the encoder, causal
  ones in the decoder's self-attention, none in cross-attention;
- RMSNorm without mean or bias (the variance in fp32);
- the feed-forward is ReLU (T5) or gated GELU with the tanh approximation (v1.1, Flan-T5: "gated-gelu");
- the decoder's output is scaled by d_model^-0.5 before the LM head where the config ties the head (T5
  v1.0; `tie_word_embeddings` absent counts as tied) or says `scale_decoder_outputs` (transformers 5, which
  writes `tie_word_embeddings: true` for every T5 and keeps the old rule there); the head is the
  checkpoint's `lm_head.weight` where it differs from the embeddings, else the embeddings.

fp16 is refused: T5 v1.1 activations overflow it. The decoder works on one sequence at a time here, over
a KV cache the caller keeps (`DecoderCache`): the engine's paged cache and batching come on top (issue 51).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from services.common.errors import ConfigError, CorruptModelError, ModelLoadError

ARCHITECTURE = "T5ForConditionalGeneration"
FEED_FORWARD = {"relu": (False, "relu"), "gated-gelu": (True, "gelu_tanh")}  # feed_forward_proj: gated, act


@dataclass(frozen=True)
class T5Config:
    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int  # the encoder's
    num_decoder_layers: int
    num_heads: int
    num_buckets: int  # relative_attention_num_buckets
    max_distance: int  # relative_attention_max_distance
    is_gated: bool
    layer_norm_epsilon: float
    tie_word_embeddings: bool  # what config.json says; the head itself follows the weights (T5Model)
    scale_decoder_output: bool  # multiply by d_model^-0.5 before the LM head (a tied head's rule)
    decoder_start_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> T5Config:
        """A T5 config.json; a feed-forward this family does not run is a ModelLoadError."""
        proj = str(raw.get("feed_forward_proj", "relu"))
        if proj not in FEED_FORWARD:
            known = ", ".join(FEED_FORWARD)
            raise ModelLoadError(f"T5 feed_forward_proj {proj!r} is not supported (known: {known})")
        try:
            tie = raw.get("tie_word_embeddings") is not False  # absent: tied (T5 v1.0)
            eos = raw.get("eos_token_id", 1)
            num_layers = int(raw["num_layers"])
            return cls(
                vocab_size=int(raw["vocab_size"]),
                d_model=int(raw["d_model"]),
                d_kv=int(raw["d_kv"]),
                d_ff=int(raw["d_ff"]),
                num_layers=num_layers,
                num_decoder_layers=int(raw.get("num_decoder_layers") or num_layers),
                num_heads=int(raw["num_heads"]),
                num_buckets=int(raw.get("relative_attention_num_buckets", 32)),
                max_distance=int(raw.get("relative_attention_max_distance", 128)),
                is_gated=FEED_FORWARD[proj][0],
                layer_norm_epsilon=float(raw.get("layer_norm_epsilon", 1e-6)),
                tie_word_embeddings=tie,
                scale_decoder_output=bool(raw.get("scale_decoder_outputs", tie)),
                decoder_start_token_id=int(raw.get("decoder_start_token_id", raw.get("pad_token_id", 0))),
                eos_token_ids=tuple(eos) if isinstance(eos, list) else (int(eos),),
                pad_token_id=int(raw.get("pad_token_id", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptModelError(f"T5 config.json lacks or garbles {exc}") from exc

    @property
    def inner_dim(self) -> int:
        return self.num_heads * self.d_kv


def relative_position_bucket(
    relative_position: torch.Tensor, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """T5's bucket of each (key position - query position): exact for small distances, logarithmic up to
    max_distance, the last bucket beyond; bidirectional splits the buckets between the two directions."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -relative_position.clamp(max=0)
    max_exact = num_buckets // 2
    scaled = torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (scaled * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < max_exact, distance, large)


# A bias table old checkpoints (t5-small, t5-base) keep for cross-attention, which no T5 uses.
_CROSS_BIAS = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
# The input embeddings: `shared`, which the stacks' tables repeat (some checkpoints keep only those).
_EMBED_NAMES = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def _embedding(weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The one embedding table: `shared`, else a stack's; stacks whose tables differ are refused."""
    tables = [weights[name] for name in _EMBED_NAMES if name in weights]
    if not tables:
        raise CorruptModelError("weight 'shared.weight' is missing from the model's weights")
    if any(not torch.equal(table, tables[0]) for table in tables[1:]):
        raise CorruptModelError("the encoder's and decoder's embedding tables differ: T5 shares one")
    return tables[0].contiguous()


@dataclass
class _Attention:
    q: torch.Tensor  # [inner, d_model]
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor  # [d_model, inner]


@dataclass
class _FeedForward:
    wi: torch.Tensor  # [d_ff, d_model]: ReLU's input, or the gated form's GELU half (wi_0)
    wo: torch.Tensor  # [d_model, d_ff]
    wi_linear: torch.Tensor | None = None  # the gated form's linear half (wi_1)


@dataclass
class _Layer:
    self_norm: torch.Tensor
    self_attn: _Attention
    ff_norm: torch.Tensor
    ff: _FeedForward
    cross_norm: torch.Tensor | None = None  # decoder layers only
    cross_attn: _Attention | None = None


@dataclass
class DecoderCache:
    """One sequence's decoder KV: self-attention keys and values per layer, grown as it decodes, and the
    cross-attention keys and values computed once from its encoder output."""

    cross: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [heads, source_len, d_kv] each
    self_kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # [heads, len, d_kv]

    @property
    def num_tokens(self) -> int:
        return self.self_kv[0][0].shape[1] if self.self_kv else 0


class T5Model:
    def __init__(self, config: T5Config, weights: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        if dtype == torch.float16:
            raise ConfigError("the T5 family runs in float32 or bfloat16: T5 v1.1 activations overflow fp16")
        self.config, self.dtype = config, dtype
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            if name not in weights:
                raise CorruptModelError(f"weight {name!r} is missing from the model's weights")
            used.add(name)
            return weights[name].to(dtype).contiguous()

        table, head = _embedding(weights), weights.get("lm_head.weight")
        self.embed = table.to(dtype)  # [vocab, d_model]
        # The checkpoint's own head where it differs from the embeddings, whatever the config says
        # (transformers 5 writes tie_word_embeddings: true for every T5); else the embeddings.
        untied = head is not None and not torch.equal(head, table)
        self.lm_head = take("lm_head.weight") if untied else self.embed
        # The embeddings under their other names, a head equal to them, and the cross-attention bias table
        # old checkpoints carry (t5-small, t5-base) that no T5 uses.
        used |= {*_EMBED_NAMES, "lm_head.weight", _CROSS_BIAS}
        self.encoder = [
            self._layer(take, f"encoder.block.{i}.layer.", False) for i in range(config.num_layers)
        ]
        self.decoder = [
            self._layer(take, f"decoder.block.{i}.layer.", True) for i in range(config.num_decoder_layers)
        ]
        bias = "block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        self.encoder_bias = take(f"encoder.{bias}")  # [num_buckets, heads]
        self.decoder_bias = take(f"decoder.{bias}")
        self.encoder_norm = take("encoder.final_layer_norm.weight")
        self.decoder_norm = take("decoder.final_layer_norm.weight")
        unused = sorted(set(weights) - used)
        if unused:
            raise ModelLoadError(f"T5 does not use these weights: {', '.join(unused[:5])}")
        self.device = self.embed.device

    def _layer(self, take: Any, prefix: str, is_decoder: bool) -> _Layer:
        def attention(index: int, name: str) -> _Attention:
            p = f"{prefix}{index}.{name}."
            return _Attention(*(take(p + f"{w}.weight") for w in "qkvo"))

        ff_index = 2 if is_decoder else 1
        p = f"{prefix}{ff_index}.DenseReluDense."
        if self.config.is_gated:
            ff = _FeedForward(take(p + "wi_0.weight"), take(p + "wo.weight"), take(p + "wi_1.weight"))
        else:
            ff = _FeedForward(take(p + "wi.weight"), take(p + "wo.weight"))
        return _Layer(
            self_norm=take(f"{prefix}0.layer_norm.weight"),
            self_attn=attention(0, "SelfAttention"),
            ff_norm=take(f"{prefix}{ff_index}.layer_norm.weight"),
            ff=ff,
            cross_norm=take(f"{prefix}1.layer_norm.weight") if is_decoder else None,
            cross_attn=attention(1, "EncDecAttention") if is_decoder else None,
        )

    # -- shared pieces ----------------------------------------------------------------------------------

    def norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + self.config.layer_norm_epsilon)).to(x.dtype)

    def feed_forward(self, ff: _FeedForward, x: torch.Tensor) -> torch.Tensor:
        if ff.wi_linear is None:
            return F.relu(x @ ff.wi.T) @ ff.wo.T
        gelu = F.gelu(x @ ff.wi.T, approximate="tanh")
        return (gelu * (x @ ff.wi_linear.T)) @ ff.wo.T

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[tokens, inner] -> [heads, tokens, d_kv]"""
        return x.view(x.shape[0], self.config.num_heads, self.config.d_kv).transpose(0, 1)

    def _attend(
        self, attn: _Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """q [heads, T, d_kv] over k, v [heads, S, d_kv], plus bias [heads, T, S] (which carries any mask):
        the attention output after o, [T, d_model]. Unscaled scores, softmax in fp32."""
        scores = q.float() @ k.float().transpose(1, 2)  # [heads, T, S]
        if bias is not None:
            scores = scores + bias
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = (probs @ v).transpose(0, 1).reshape(q.shape[1], self.config.inner_dim)  # [T, inner]
        return out @ attn.o.T

    def position_bias(
        self,
        table: torch.Tensor,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        bidirectional: bool,
    ) -> torch.Tensor:
        """[heads, T, S] from the stack's bucket table [num_buckets, heads]; -inf past a causal query."""
        relative = key_positions[None, :] - query_positions[:, None]  # [T, S]
        buckets = relative_position_bucket(
            relative,
            bidirectional=bidirectional,
            num_buckets=self.config.num_buckets,
            max_distance=self.config.max_distance,
        )
        bias = table[buckets].permute(2, 0, 1).float()  # [heads, T, S]
        if not bidirectional:
            bias = bias.masked_fill((relative > 0)[None], float("-inf"))
        return bias

    # -- the encoder ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def encode(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The encoder output [S, d_model] of one source [S] (ending with EOS, as T5's tokenizer makes it)."""
        return self.encode_batch([token_ids])[0]

    @torch.inference_mode()
    def encode_batch(self, sources: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The encoder outputs [S_i, d_model] of several sources in one pass, padded to the longest: padded
        keys are masked out of every query, padded queries dropped. Never chunked: it is bidirectional."""
        cfg, lengths = self.config, [int(s.shape[0]) for s in sources]
        batch, longest = len(sources), max(lengths)
        ids = torch.full((batch, longest), cfg.pad_token_id, dtype=torch.long, device=self.device)
        for i, source in enumerate(sources):
            ids[i, : lengths[i]] = source
        positions = torch.arange(longest, device=self.device)
        bias = self.position_bias(self.encoder_bias, positions, positions, bidirectional=True)  # [H, S, S]
        valid = positions[None, :] < torch.tensor(lengths, device=self.device)[:, None]  # [B, S]
        bias = (
            bias[None]
            + torch.zeros_like(valid, dtype=bias.dtype).masked_fill(~valid, float("-inf"))[:, None, None, :]
        )  # [B, H, S, S]
        h = F.embedding(ids, self.embed)  # [B, S, d_model]
        for layer in self.encoder:
            x = self.norm(h, layer.self_norm)
            a = layer.self_attn
            q, k, v = (
                (x @ w.T).view(batch, longest, cfg.num_heads, cfg.d_kv).transpose(1, 2)
                for w in (a.q, a.k, a.v)
            )
            scores = q.float() @ k.float().transpose(-1, -2) + bias  # [B, H, S, S]: unscaled
            out = (torch.softmax(scores, dim=-1).to(v.dtype) @ v).transpose(1, 2)  # [B, S, H, d_kv]
            h = h + out.reshape(batch, longest, cfg.inner_dim) @ a.o.T
            h = h + self.feed_forward(layer.ff, self.norm(h, layer.ff_norm))
        h = self.norm(h, self.encoder_norm)
        return [h[i, :n] for i, n in enumerate(lengths)]

    # -- the decoder ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, encoder_output: torch.Tensor) -> DecoderCache:
        """A sequence's decoder cache: every layer's cross-attention keys and values, computed once."""
        cross = []
        for layer in self.decoder:
            a = layer.cross_attn
            assert a is not None
            cross.append((self._heads(encoder_output @ a.k.T), self._heads(encoder_output @ a.v.T)))
        return DecoderCache(cross)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """The next tokens' logits [T, vocab] (fp32) for decoder tokens [T] that follow the cache's, which
        grows by them. The first call's first token is config.decoder_start_token_id."""
        start = cache.num_tokens
        positions = torch.arange(start, start + token_ids.shape[0], device=self.device)
        keys = torch.arange(start + token_ids.shape[0], device=self.device)
        bias = self.position_bias(self.decoder_bias, positions, keys, bidirectional=False)
        h = F.embedding(token_ids, self.embed)  # [T, d_model]
        grown = []
        for i, layer in enumerate(self.decoder):
            x = self.norm(h, layer.self_norm)
            a = layer.self_attn
            q, k, v = (self._heads(x @ w.T) for w in (a.q, a.k, a.v))
            if cache.self_kv:
                k = torch.cat([cache.self_kv[i][0], k], dim=1)
                v = torch.cat([cache.self_kv[i][1], v], dim=1)
            grown.append((k, v))
            h = h + self._attend(a, q, k, v, bias)
            cross, cross_kv = layer.cross_attn, cache.cross[i]
            assert cross is not None and layer.cross_norm is not None
            q = self._heads(self.norm(h, layer.cross_norm) @ cross.q.T)
            h = h + self._attend(cross, q, cross_kv[0], cross_kv[1], None)
            h = h + self.feed_forward(layer.ff, self.norm(h, layer.ff_norm))
        cache.self_kv = grown
        h = self.norm(h, self.decoder_norm)
        if self.config.scale_decoder_output:
            h = h * self.config.d_model**-0.5
        return (h @ self.lm_head.T).float()
