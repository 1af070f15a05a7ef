"""Turns a scheduler step into tensors, runs the model, and samples. Tensors live here and below.

`ModelRunner` is the engine's `Runner` (runner_protocol.py) over a real model and its KV cache tensors.
The step's inputs are built on the host and copied to the cache's device (CPU or CUDA); logits, sampling
and logprobs stay on the device, and the sampled token IDs coming back are the step's one host wait. Rows
with a grammar get their masks filled on the host once the forward is queued (grammar_mask.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.common.outputs import TokenLogprob
from services.engine.cuda_graphs import DecodeGraphs
from services.engine.layers.attention_metadata import RowSpec, build_metadata, slots_of, to_device
from services.engine.layers.grammar_mask import GrammarMask
from services.engine.layers.sampler import DeviceSample, SamplingBatch, SamplingRow, sample_on_device
from services.engine.models.registry import CausalLM
from services.engine.models.t5_paged import CrossRow
from services.engine.runner_protocol import PendingStep, ReadyStep, StepResult
from services.engine.scheduling.request import Request, SeqId
from services.engine.scheduling.scheduler import ScheduledChunk, SchedulerOutput


@dataclass
class _Sampled:
    """The last launch's picks on the device, by sequence: where the next launch reads placeholders."""

    token_ids: torch.Tensor  # [num_samples] int64
    rows: dict[SeqId, int]


@dataclass
class _PendingSample:
    """A launched step's picks on their way to host memory; `collect` waits for them."""

    sample: DeviceSample
    seq_ids: list[SeqId]
    copied: torch.cuda.Event | None  # recorded after the copies were queued; None on a CPU

    def collect(self) -> StepResult:
        if self.copied is not None:
            self.copied.synchronize()
        out = self.sample.to_host()
        result: dict[SeqId, TokenLogprob] = {}
        for i, seq_id in enumerate(self.seq_ids):
            logprob = out.logprobs[i] if out.logprobs is not None else 0.0
            top = out.top_logprobs[i] if out.top_logprobs is not None else []
            result[seq_id] = TokenLogprob(out.token_ids[i], logprob, top)
        return StepResult(result)


class ModelRunner:
    def __init__(
        self, model: CausalLM, kv_caches: list[torch.Tensor], block_size: int, vocab_size: int, seed: int
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.generator = torch.Generator(device=kv_caches[0].device).manual_seed(seed)
        # Called on the engine thread right before each forward, once the step's inputs are built: the
        # async engine hands out the previous step's outputs there, so the service threads do their
        # Python work while the forward runs without the GIL instead of stalling the step's set-up.
        self._before_forward: Callable[[], None] | None = None
        self._previous: _Sampled | None = None
        # Encoder-decoder models: each batched encoder pass's seconds since `take_encoder_times`, and
        # the sequences and source tokens encoded here so far.
        self._encoder_times: list[float] = []
        self.num_encoded_sequences = 0
        self.num_encoded_tokens = 0
        self.graphs: DecodeGraphs | None = None  # decode steps replay captured graphs (cuda_graphs.py)
        self.grammar_mask = GrammarMask(vocab_size, self.device)

    @property
    def weight_dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.kv_caches[0].device

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.kv_caches[0].dtype

    def set_before_forward(self, hook: Callable[[], None] | None) -> None:
        self._before_forward = hook

    def execute(self, step: SchedulerOutput) -> StepResult:
        return self.launch(step).collect()

    def launch(self, step: SchedulerOutput) -> PendingStep:
        decode = [c for c in step.chunks if c.num_new_tokens == 1]
        prefill = [c for c in step.chunks if c.num_new_tokens > 1]
        ordered = decode + prefill
        meta = build_metadata(
            [_row(c) for c in decode], [_row(c) for c in prefill], self.block_size, self.device
        )
        token_ids: list[int] = []
        logits_indices: list[int] = []
        sampling_chunks: list[ScheduledChunk] = []
        for chunk in ordered:
            req = chunk.request
            token_ids.extend(
                req.token_ids[chunk.start_position : chunk.start_position + chunk.num_new_tokens]
            )
            if chunk.samples:
                logits_indices.append(len(token_ids) - 1)
                sampling_chunks.append(chunk)
        token_tensor = to_device(token_ids, self.device)  # [num_tokens]
        self._fill_placeholders(token_tensor, ordered)
        indices = to_device(logits_indices, self.device)  # [num_samples]
        if self._before_forward is not None:
            self._before_forward()
        graphs = self.graphs
        if getattr(self.model, "is_encoder_decoder", False):  # [num_samples, vocab]
            logits = self.model.forward(token_tensor, self.kv_caches, meta, indices, self._cross(ordered))  # type: ignore[call-arg]
        elif graphs is not None and not prefill and graphs.bucket_for(len(decode)) is not None:
            logits = graphs.run(token_tensor, meta)[indices]  # [num_samples, vocab]
        else:
            logits = self.model.forward(token_tensor, self.kv_caches, meta, indices)  # [num_samples, vocab]
        if not sampling_chunks:
            self._previous = None
            return ReadyStep(StepResult({}))
        requests = [c.request for c in sampling_chunks]
        picks = self._sample(logits, requests)
        seq_ids = [r.seq_id for r in requests]
        self._previous = _Sampled(picks.token_ids, {seq_id: i for i, seq_id in enumerate(seq_ids)})
        copied = None
        host = picks.copy_to_host()
        if self.device.type == "cuda":  # on this device's stream, which queued the copies; no busy wait
            copied = torch.cuda.Event(blocking=True)
            copied.record(torch.cuda.current_stream(self.device))
        return _PendingSample(host, seq_ids, copied)

    def _cross(self, chunks: list[ScheduledChunk]) -> list[CrossRow]:
        """Encoder-decoder models: each row's cross KV, encoded first, in one batch, for the sequences
        admitted since their last step (new, or readmitted after a preemption)."""
        rows = [CrossRow(c.request.cross_block_ids, len(c.request.encoder_token_ids)) for c in chunks]
        new = [(c.request, row) for c, row in zip(chunks, rows, strict=True) if c.request.needs_encoding]
        if new:
            sources = [request.encoder_token_ids for request, _ in new]
            encode_into = self.model.encode_into  # type: ignore[attr-defined]  # T5ForEngine's
            started_ns = time.time_ns()
            outputs = encode_into(sources, [row for _, row in new], self.kv_caches, self.block_size)
            ended_ns = time.time_ns()
            self._encoder_times.append((ended_ns - started_ns) / 1e9)
            self.num_encoded_sequences += len(new)
            self.num_encoded_tokens += sum(len(source) for source in sources)
            for (request, _), output in zip(new, outputs, strict=True):
                request.needs_encoding = False
                request.encode_times_ns = (started_ns, ended_ns)
                if request.export_kv_from is not None:  # a prefill replica ships it (core._export)
                    request.encoder_output = output.clone()  # not a view holding the padded batch
        return rows

    def take_encoder_times(self) -> list[float]:
        """The seconds of each batched encoder pass since the last call. Host time: on a GPU, the time to
        queue the pass and its cross KV writes (the device may still be running them)."""
        times, self._encoder_times = self._encoder_times, []
        return times

    def write_cross(self, request: Request, encoder_states: torch.Tensor) -> None:
        """A decode replica's encoder-decoder request: its cross KV from the encoder output a prefill
        replica shipped [S, d_model], into its cross blocks; it needs no encoding here then."""
        states = encoder_states.to(self.device, self.weight_dtype)
        row = CrossRow(request.cross_block_ids, len(request.encoder_token_ids))
        self.model.write_cross(states, row, self.kv_caches, self.block_size)  # type: ignore[attr-defined]
        request.needs_encoding = False

    def _fill_placeholders(self, token_tensor: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
        """Write the previous launch's picks (still on the device) over this step's PLACEHOLDER inputs:
        a request's pending token, always its last (the one the previous launch sampled)."""
        positions, rows = [], []
        offset = 0
        for chunk in chunks:
            request, start = chunk.request, chunk.start_position
            last = request.num_tokens - 1
            if request.num_pending_tokens and start <= last < start + chunk.num_new_tokens:
                positions.append(offset + last - start)
                rows.append(self._previous_row(request))
            offset += chunk.num_new_tokens
        if positions:
            assert self._previous is not None  # _previous_row checked it
            sources = to_device(rows, self.device)  # [num_placeholders]
            token_tensor[to_device(positions, self.device)] = self._previous.token_ids[sources]

    def _previous_row(self, request: Request) -> int:
        previous = self._previous
        if request.num_pending_tokens > 1 or previous is None or request.seq_id not in previous.rows:
            raise RuntimeError(f"{request.seq_id} has a placeholder the last launch did not sample")
        return previous.rows[request.seq_id]

    def read_kv(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        """A copy of the KV at positions start..end-1: [num_layers, end - start, 2, kv_heads, head_dim]."""
        slots = self._slots(block_ids, start, end)
        return torch.stack([cache.index_select(0, slots) for cache in self.kv_caches])

    def write_kv(self, block_ids: list[int], start: int, kv: torch.Tensor) -> None:
        """Store `kv` [num_layers, num_tokens, 2, kv_heads, head_dim] at positions start.. ."""
        if kv.shape[0] != len(self.kv_caches) or kv.shape[2:] != self.kv_caches[0].shape[1:]:
            raise ValueError(f"KV of shape {tuple(kv.shape)} does not fit this model's cache")
        if kv.dtype != self.kv_dtype:  # never converted here: the transfer handshake agrees on the dtype
            raise ValueError(f"KV in {kv.dtype} does not fit this model's {self.kv_dtype} cache")
        slots = self._slots(block_ids, start, start + kv.shape[1])
        kv = kv.to(self.device, non_blocking=True)
        for cache, layer_kv in zip(self.kv_caches, kv, strict=True):
            cache.index_copy_(0, slots, layer_kv)

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        return to_device(slots_of(block_ids, start, end, self.block_size), self.device)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> DeviceSample:
        banned = [_banned(r) for r in requests]
        allowed = self.grammar_mask.fill(requests, banned)  # a grammar row's bans go into its mask
        rows = [
            SamplingRow(
                params=r.params,
                prompt_token_ids=r.prompt_token_ids,
                output_token_ids=r.output_token_ids,
                banned_token_ids=() if r.matcher is not None else bans,
            )
            for r, bans in zip(requests, banned, strict=True)
        ]
        batch = SamplingBatch.build(rows, self.vocab_size, self.device, allowed)
        return sample_on_device(logits[:, : self.vocab_size], batch, self.generator)


def _row(chunk: ScheduledChunk) -> RowSpec:
    return RowSpec(chunk.request.block_ids, chunk.start_position, chunk.num_new_tokens)


def _banned(request: Request) -> tuple[int, ...]:
    """EOS and stop tokens are banned until min_tokens outputs exist. With a grammar, EOS under
    ignore_eos too: it stays possible only where the grammar allows nothing else (grammar_mask.py)."""
    params = request.params
    banned: set[int] = set()
    if request.num_output_tokens < params.min_tokens:
        banned |= set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= request.eos_token_ids
    if request.matcher is not None and params.ignore_eos:
        banned |= request.eos_token_ids
    return tuple(sorted(banned))
