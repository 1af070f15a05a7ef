"""A step's attention metadata: built once per step on the host from the scheduled rows, copied to the
cache's device in one copy per tensor, and read by every layer's attention backend.

The cache of one layer is a flat array of slots, `[num_slots, 2, num_kv_heads, head_dim]`, where slot
`block_id * block_size + offset` holds the K (index 0) and V (index 1) of one token. A step's tokens are
laid out flat: every decode row (one query token each) first, then every prefill chunk. Nothing in a layer
builds tensors on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class RowSpec:
    """One sequence in a step: its block table, where its new tokens start, and how many there are."""

    block_ids: Sequence[int]
    start_position: int
    num_new_tokens: int

    @property
    def context_len(self) -> int:
        return self.start_position + self.num_new_tokens


@dataclass
class GroupMetadata:
    num_rows: int
    gather_slots: torch.Tensor  # [num_rows, max_ctx] slot of each context token (padding -> 0)
    mask: torch.Tensor | None  # [num_rows, 1, max_q, max_ctx] True = may attend; None = attend all
    query_index: torch.Tensor | None  # [num_rows, max_q] index into the group's flat tokens
    query_valid: torch.Tensor | None  # [num_rows, max_q] False on padded query slots

    def to(self, device: torch.device) -> GroupMetadata:
        if device.type == "cpu":
            return self
        move = _move(device)
        return GroupMetadata(
            self.num_rows, move(self.gather_slots), _opt(self.mask, move), _opt(self.query_index, move),
            _opt(self.query_valid, move),
        )  # fmt: skip


def _move(device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.pin_memory().to(device, non_blocking=True)


def _opt(tensor: torch.Tensor | None, move: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor | None:
    return None if tensor is None else move(tensor)


@dataclass
class AttentionMetadata:
    """One step's layout, shared by every layer. The torch path's gather groups are built on first use."""

    decode_rows: Sequence[RowSpec]
    prefill_rows: Sequence[RowSpec]
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's K/V is written
    positions: torch.Tensor  # [num_tokens]
    token_rows: torch.Tensor  # [num_tokens] index of each token's row in block_tables
    block_tables: torch.Tensor  # [num_rows, max_blocks] block ids, padding -> 0
    max_context_len: int
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _groups: dict[tuple[bool, int | None], GroupMetadata] = field(default_factory=dict, repr=False)
    # What an attention backend derives once per step and reuses in every layer, keyed by the backend.
    backend_state: dict[object, object] = field(default_factory=dict, repr=False)
    _fresh_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_rows)

    @property
    def num_prefill_key_reads(self) -> int:
        """Query-key pairs of the prefill rows: their attention work, which grows with their context."""
        return sum(r.num_new_tokens * r.context_len for r in self.prefill_rows)

    @property
    def is_fresh_prompt(self) -> bool:
        """One prefill row starting at position 0 and nothing else: its context is exactly its new K/V."""
        rows = self.prefill_rows
        return not self.decode_rows and len(rows) == 1 and rows[0].start_position == 0

    def group(self, is_decode: bool, window: int | None = None) -> GroupMetadata | None:
        rows = self.decode_rows if is_decode else self.prefill_rows
        if not rows:
            return None
        key = (is_decode, window)
        if key not in self._groups:
            self._groups[key] = _group(rows, self.block_size, is_decode, window).to(self.device)
        return self._groups[key]

    def fresh_prompt_mask(self, window: int) -> torch.Tensor | None:
        """The causal sliding-window mask of a lone fresh prompt [num_tokens, num_tokens] (True = may
        attend), or None when the prompt fits in the window and plain causal attention is the same."""
        num_tokens = self.num_tokens
        if num_tokens <= window:
            return None
        if window not in self._fresh_masks:
            pos = torch.arange(num_tokens, device=self.device)  # [num_tokens]
            offset = pos[:, None] - pos[None, :]  # [num_tokens (query), num_tokens (key)]
            self._fresh_masks[window] = (offset >= 0) & (offset < window)
        return self._fresh_masks[window]


def build_metadata(
    decode_rows: Sequence[RowSpec],
    prefill_rows: Sequence[RowSpec],
    block_size: int,
    device: torch.device | None = None,
) -> AttentionMetadata:
    """Metadata for one step on `device` (the CPU by default). Rows must be given in the flat token order:
    decode rows, then prefill."""
    device = device or torch.device("cpu")
    rows = (*decode_rows, *prefill_rows)
    slot_mapping: list[int] = []
    positions: list[int] = []
    token_rows: list[int] = []
    tables: list[list[int]] = []
    max_blocks = max(-(-r.context_len // block_size) for r in rows)
    for i, row in enumerate(rows):  # per row and per block, never per token
        table = _table(row.block_ids, max_blocks)
        tables.append(table)
        positions.extend(range(row.start_position, row.context_len))
        slot_mapping.extend(slots_of(table, row.start_position, row.context_len, block_size))
        token_rows.extend([i] * row.num_new_tokens)
    return AttentionMetadata(
        decode_rows=decode_rows,
        prefill_rows=prefill_rows,
        block_size=block_size,
        slot_mapping=to_device(slot_mapping, device),  # [num_tokens]
        positions=to_device(positions, device),  # [num_tokens]
        token_rows=to_device(token_rows, device),  # [num_tokens]
        block_tables=to_device(tables, device),  # [num_rows, max_blocks]
        max_context_len=max(r.context_len for r in rows),
        device=device,
    )


def to_device(
    values: Sequence[float] | Sequence[Sequence[int]],
    device: torch.device | str,
    dtype: torch.dtype = torch.long,
) -> torch.Tensor:
    """A tensor of `values` (int64 unless `dtype` says otherwise) on `device`, built on the host and copied
    through pinned memory, so the copy to a GPU is queued without waiting (the step's one wait is for its
    sampled tokens). Never `torch.tensor(values, device=gpu)`: that copy blocks the host on the stream."""
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def slots_of(block_ids: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slots of positions start..end-1 (block_ids[p // block_size] * block_size + p % block_size),
    built one block's run at a time."""
    slots: list[int] = []
    for b in range(start // block_size, -(-end // block_size)):
        first, last = max(start, b * block_size), min(end, (b + 1) * block_size)
        shift = (block_ids[b] - b) * block_size
        slots.extend(range(first + shift, last + shift))
    return slots


def _table(block_ids: Sequence[int], num_blocks: int) -> list[int]:
    """A row's first `num_blocks` block ids, freed ones (NO_BLOCK) read as 0, padded with 0."""
    table = [max(b, 0) for b in block_ids[:num_blocks]]
    return table + [0] * (num_blocks - len(table))


def _group(rows: Sequence[RowSpec], block_size: int, is_decode: bool, window: int | None) -> GroupMetadata:
    max_ctx = max(r.context_len for r in rows)
    max_blocks = -(-max_ctx // block_size)
    table = torch.tensor([_table(r.block_ids, max_blocks) for r in rows])  # [num_rows, max_blocks]
    key_pos = torch.arange(max_ctx)  # [max_ctx]
    gather = table[:, key_pos // block_size] * block_size + key_pos % block_size  # [num_rows, max_ctx]
    ctx_lens = torch.tensor([r.context_len for r in rows])  # [num_rows]
    if is_decode:
        in_ctx = key_pos[None, :] < ctx_lens[:, None]  # [num_rows, max_ctx]
        if window is not None:
            in_ctx &= key_pos[None, :] > ctx_lens[:, None] - 1 - window
        mask = None if bool(in_ctx.all()) else in_ctx[:, None, None, :]  # [num_rows, 1, 1, max_ctx]
        return GroupMetadata(len(rows), gather, mask, None, None)
    max_q = max(r.num_new_tokens for r in rows)
    q_lens = torch.tensor([r.num_new_tokens for r in rows])  # [num_rows]
    starts = torch.tensor([r.start_position for r in rows])  # [num_rows]
    q_off = torch.arange(max_q)  # [max_q]
    query_pos = starts[:, None] + q_off[None, :]  # [num_rows, max_q]
    causal = key_pos[None, None, :] <= query_pos[:, :, None]  # [num_rows, max_q, max_ctx]
    if window is not None:
        causal &= key_pos[None, None, :] > query_pos[:, :, None] - window
    in_ctx = key_pos[None, None, :] < ctx_lens[:, None, None]  # [num_rows, 1, max_ctx]
    mask = (causal & in_ctx)[:, None]  # [num_rows, 1, max_q, max_ctx]
    valid = q_off[None, :] < q_lens[:, None]  # [num_rows, max_q]
    first = torch.cumsum(q_lens, 0) - q_lens  # [num_rows] offset of each row in the flat tokens
    query_index = torch.where(valid, first[:, None] + q_off[None, :], 0)  # [num_rows, max_q]
    return GroupMetadata(len(rows), gather, mask, query_index, valid)
