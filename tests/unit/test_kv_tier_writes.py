"""Writing through to the KV tiers and reading back (services/engine/kv_tiers.py): as a request leaves,
every full segment of what it computed goes to the tiers, under its tenant, holding exactly its KV; a fresh
engine admitting the same prefix reads it back instead of recomputing. A fake runner stands in for
the model: its KV holds each slot's token ID (K) and position (V), so a segment's bytes say which tokens
they are the KV of."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from services.common.block_hash import hash_token_blocks
from services.common.engine_input import CacheBreakpoint
from services.common.sampling import SamplingParams
from services.engine.core import EngineCore, RequestOutput
from services.engine.kv_tiers import KVTiers, SegmentReads, SegmentWrites
from services.kvcache.disk_tier import DiskTier
from services.kvcache.host_tier import HostTier
from services.kvcache.segment import Namespace, SegmentMiss, decode, segment_key
from services.kvcache.tier_set import SegmentWriter, TierSet
from tests.engine_fakes import FAKE_MANIFEST, FAKE_MODEL, make_fake_engine
from tests.engine_helpers import drain

BLOCK = 16
SEGMENT = 2 * BLOCK
NS = Namespace(
    FAKE_MANIFEST.model_fingerprint, "safetensors", "float32", "float32", BLOCK,
    FAKE_MODEL.num_layers, FAKE_MODEL.num_kv_heads, FAKE_MODEL.head_dim,
)  # fmt: skip


class GatedDisk(DiskTier):
    """The disk tier, whose reads wait until `gate` is set: a lookup that takes as long as a test wants."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, 1 << 30)
        self.gate = threading.Event()

    def get(self, key: str) -> bytes | None:
        self.gate.wait()
        return super().get(key)


def engine_with_tiers(
    tmp_path: Path, disk: DiskTier | None = None, deadline_s: float = 60.0
) -> tuple[EngineCore, DiskTier, SegmentWriter, SegmentReads]:
    """A fresh engine reading from and writing to the disk tier at `tmp_path` (or `disk`)."""
    engine = make_fake_engine(kv_cache_memory_mb=4, block_size=BLOCK)
    disk = disk or DiskTier(tmp_path, 1 << 30)
    tiers = TierSet([disk])
    writer = SegmentWriter(tiers)
    writes = SegmentWrites(NS, SEGMENT, writer, engine.runner.read_kv)
    reads = SegmentReads(NS, SEGMENT, tiers, engine.runner.write_kv, deadline_s, torch.device("cpu"))
    engine.use_tiers(KVTiers(tiers, writes, reads))
    return engine, disk, writer, reads


def engine_writing_to(tmp_path: Path) -> tuple[EngineCore, DiskTier, SegmentWriter]:
    engine, disk, writer, _ = engine_with_tiers(tmp_path)
    return engine, disk, writer


def stored_segments(
    engine: EngineCore, disk: DiskTier, token_ids: list[int], salt: bytes
) -> list[torch.Tensor]:
    """The KV of each segment of `token_ids` the disk holds, in order, up to the first it lacks."""
    hashes = hash_token_blocks(engine.root_hash, token_ids, BLOCK, salt)
    found = []
    for start in range(0, len(hashes) * BLOCK - SEGMENT + 1, SEGMENT):
        seg_hashes = hashes[start // BLOCK : (start + SEGMENT) // BLOCK]
        value = disk.get(segment_key(NS, salt, seg_hashes[-1]))
        if value is None:
            break
        payload = decode(value, NS, salt, start, seg_hashes)
        shape = (NS.num_layers, SEGMENT, 2, NS.num_kv_heads, NS.head_dim)
        found.append(torch.frombuffer(bytearray(payload), dtype=torch.float32).view(shape))
    return found


def test_a_finished_request_leaves_every_full_segment_of_its_prompt_and_output(tmp_path: Path) -> None:
    engine, disk, writer = engine_writing_to(tmp_path)
    prompt = [(7 * i) % 100 + 2 for i in range(70)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=27, ignore_eos=True), cache_salt=b"tenant-a")
    outputs = drain(engine)
    assert writer.wait_idle(10)
    tokens = prompt + [o.new_token_ids[0] for o in outputs][:-1]  # the last sampled token has no KV
    segments = stored_segments(engine, disk, tokens, b"tenant-a")
    assert len(segments) == len(tokens) // SEGMENT == 3  # 96 tokens with KV (70 + 26): three segments
    for index, kv in enumerate(segments):
        start = index * SEGMENT
        assert (kv[:, :, 0] == kv[0, :, 0, 0, 0].view(1, -1, 1, 1)).all()  # one value per token, every layer
        assert kv[0, :, 0, 0, 0].tolist() == tokens[start : start + SEGMENT]  # K: these tokens
        assert kv[0, :, 1, 0, 0].tolist() == list(range(start, start + SEGMENT))  # V: these positions
    engine.close()


def test_segments_are_the_tenants_own(tmp_path: Path) -> None:
    engine, disk, writer = engine_writing_to(tmp_path)
    prompt = list(range(2, 66))
    engine.add_request("a", prompt, SamplingParams(max_tokens=1), cache_salt=b"tenant-a")
    drain(engine)
    assert writer.wait_idle(10)
    assert len(stored_segments(engine, disk, prompt, b"tenant-a")) == 2  # the 64 prompt tokens
    assert stored_segments(engine, disk, prompt, b"tenant-b") == []  # B's keys: nothing there
    hashes = hash_token_blocks(engine.root_hash, prompt, BLOCK, b"tenant-a")[:2]
    value = disk.get(segment_key(NS, b"tenant-a", hashes[-1]))
    assert value is not None
    try:
        decode(value, NS, b"tenant-b", 0, hashes)
        raise AssertionError("tenant B decoded tenant A's segment")
    except SegmentMiss as miss:
        assert "tenant" in str(miss)
    engine.close()


def test_an_aborted_request_and_a_repeated_segment_are_not_written(tmp_path: Path) -> None:
    engine, _, writer = engine_writing_to(tmp_path)
    prompt = list(range(2, 70))
    engine.add_request("gone", prompt, SamplingParams(max_tokens=50))
    engine.step()
    engine.abort(["gone"])
    drain(engine)
    assert writer.wait_idle(10)
    assert not list(tmp_path.rglob("*.kvs"))
    engine.add_request("one", prompt, SamplingParams(max_tokens=1))
    drain(engine)
    engine.add_request("two", prompt, SamplingParams(max_tokens=1))  # the same prefix: known to the writer
    reads_before = len(engine.runner.kv_reads)  # type: ignore[attr-defined]
    drain(engine)
    assert len(engine.runner.kv_reads) == reads_before  # type: ignore[attr-defined]  # not copied out again
    assert writer.wait_idle(10)
    assert len(list(tmp_path.rglob("*.kvs"))) == 2
    engine.close()


def fetched(reads: SegmentReads) -> int:
    """The prompt tokens the tiers have given the engine so far."""
    return reads.tiers.report().stats.fetched_tokens


def answer(engine: EngineCore, request_id: str, prompt: list[int], salt: bytes) -> tuple[list[int], int]:
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)  # a function of the KV read
    engine.add_request(request_id, prompt, greedy, cache_salt=salt)
    outputs = drain(engine)
    return [o.new_token_ids[0] for o in outputs], outputs[-1].num_cached_tokens


def test_a_fresh_engine_reads_a_prefix_back_and_answers_the_same(tmp_path: Path) -> None:
    first, *_ = engine_with_tiers(tmp_path)
    prompt = [(5 * i) % 100 + 2 for i in range(70)]
    cold_tokens, cold_cached = answer(first, "a", prompt, b"tenant-a")
    first.close()
    assert cold_cached == 0
    second, *_, reads = engine_with_tiers(tmp_path)  # a restarted worker: an empty pool, the same disk
    tokens, cached = answer(second, "b", prompt, b"tenant-a")
    assert cached == 64  # two segments; the one holding the last prompt token is recomputed
    assert fetched(reads) == 64
    assert tokens == cold_tokens  # the fake samples from the KV it reads: every loaded slot was right
    second.check_invariants()
    other, *_ = engine_with_tiers(tmp_path)
    assert answer(other, "c", prompt, b"tenant-b")[1] == 0  # another tenant reads nothing


def test_a_local_hit_inside_a_segment_takes_only_the_rest_from_below(tmp_path: Path) -> None:
    first, *_ = engine_with_tiers(tmp_path)
    prompt = [(3 * i) % 100 + 2 for i in range(70)]
    cold_tokens, _ = answer(first, "a", prompt, b"")
    first.close()
    second, *_, reads = engine_with_tiers(tmp_path)
    answer(second, "warm", prompt[:20], b"")  # 16 tokens of the first segment now in the pool
    fetched_before = fetched(reads)
    tokens, cached = answer(second, "b", prompt, b"")
    assert cached == 64 and fetched(reads) - fetched_before == 48
    assert tokens == cold_tokens


def written_through(tmp_path: Path) -> tuple[list[int], list[int]]:
    """A prompt answered by an engine that wrote its segments to the disk at `tmp_path`, and its tokens."""
    first, *_ = engine_with_tiers(tmp_path)
    prompt = [(5 * i) % 100 + 2 for i in range(70)]
    cold_tokens, _ = answer(first, "a", prompt, b"")
    first.close()
    return prompt, cold_tokens


def test_a_lookup_runs_off_the_engine_thread_and_others_are_served_meanwhile(tmp_path: Path) -> None:
    prompt, cold_tokens = written_through(tmp_path)
    disk = GatedDisk(tmp_path)
    second, *_ = engine_with_tiers(tmp_path, disk)
    greedy = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    second.add_request("slow", prompt, greedy)  # its lookup waits at the gate
    second.add_request("other", [3, 4, 5, 6, 7], greedy)
    outputs = []
    while not any(o.request_id == "other" and o.finish_reason for o in outputs):
        outputs += second.step()
    assert {o.request_id for o in outputs} == {"other"}  # served while "slow" waited for its lookup
    disk.gate.set()
    outputs = drain(second)
    assert [o.new_token_ids[0] for o in outputs] == cold_tokens
    assert outputs[-1].num_cached_tokens == 64


def test_a_lookup_past_its_deadline_recomputes_and_its_result_is_dropped(tmp_path: Path) -> None:
    prompt, cold_tokens = written_through(tmp_path)
    disk = GatedDisk(tmp_path)
    second, _, _, reads = engine_with_tiers(tmp_path, disk, deadline_s=0.05)
    tokens, cached = answer(second, "b", prompt, b"")  # the gate stays shut: the deadline passes
    assert (tokens, cached) == (cold_tokens, 0)
    assert reads.tiers.report().stats.late_lookups == 1
    disk.gate.set()  # the lookup ends now, unread
    second.check_invariants()
    second.close()


def _flip_last_byte(value: bytes) -> bytes:
    return value[:-1] + bytes([value[-1] ^ 0xFF])


def _foreign_block_size(value: bytes) -> bytes:
    """The same bytes under a header that names another block size (a value from another deployment)."""
    return value.replace(f'"block_size":{BLOCK}'.encode(), f'"block_size":{BLOCK * 2}'.encode())


DAMAGE = {
    "corrupted": _flip_last_byte,  # the payload's checksum differs
    "truncated": lambda value: value[: len(value) // 2],
    "foreign": _foreign_block_size,
    "evicted": None,  # gone from the tier
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("segment", [0, 1])
def test_a_damaged_foreign_or_missing_segment_is_a_miss_that_recomputes(
    tmp_path: Path, damage: str, segment: int
) -> None:
    """Two segments written through; one is then damaged on disk. A fresh engine uses the run before it
    (segment 1 damaged: segment 0 still loads), recomputes the rest, and answers with the same tokens."""
    prompt, cold_tokens = written_through(tmp_path)
    hashes = hash_token_blocks(make_fake_engine(block_size=BLOCK).root_hash, prompt, BLOCK, b"")
    key = segment_key(NS, b"", hashes[(segment + 1) * SEGMENT // BLOCK - 1])
    path = DiskTier(tmp_path, 1 << 30)._path(key)
    mutate = DAMAGE[damage]
    if mutate is None:
        path.unlink()
    else:
        path.write_bytes(mutate(path.read_bytes()))
    engine, _, _, reads = engine_with_tiers(tmp_path)
    tokens, cached = answer(engine, "b", prompt, b"")
    assert tokens == cold_tokens
    assert cached == segment * SEGMENT
    stats = reads.tiers.report().stats
    assert stats.corrupt["disk"] == (0 if mutate is None else 1)
    engine.check_invariants()
    engine.close()  # the writes finish: the recomputed segment is written through again, whole
    seg_hashes = hashes[segment * SEGMENT // BLOCK : (segment + 1) * SEGMENT // BLOCK]
    assert decode(path.read_bytes(), NS, b"", segment * SEGMENT, seg_hashes)


def test_a_cache_breakpoint_writes_its_prefix_through_and_is_read_back_to_its_block(tmp_path: Path) -> None:
    """Writing through only what was asked (`write_through: requested`): a request without a breakpoint
    leaves its segments in the host tier only; one with a breakpoint inside its second segment writes the
    first segment and the tail up to the breakpoint's block to disk; a fresh engine with that disk reads
    both back for a request that asks again, and only the whole segment for one that does not."""

    def engine_on(disk: DiskTier) -> tuple[EngineCore, HostTier, SegmentWriter]:
        engine = make_fake_engine(kv_cache_memory_mb=4, block_size=BLOCK)
        host = HostTier(1 << 30)
        tiers = TierSet([host, disk])
        writer = SegmentWriter(tiers)
        writes = SegmentWrites(NS, SEGMENT, writer, engine.runner.read_kv, write_through=False)
        reads = SegmentReads(NS, SEGMENT, tiers, engine.runner.write_kv, 60.0, torch.device("cpu"))
        engine.use_tiers(KVTiers(tiers, writes, reads))
        return engine, host, writer

    def run(
        engine: EngineCore, request_id: str, prompt: list[int], *points: CacheBreakpoint
    ) -> RequestOutput:
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        engine.add_request(request_id, prompt, greedy, cache_salt=b"t", cache_breakpoints=points)
        return drain(engine)[-1]

    disk = DiskTier(tmp_path, 1 << 30)
    first, host, writer = engine_on(disk)
    asked = [(3 * i) % 100 + 2 for i in range(70)]
    plain = [(11 * i) % 100 + 2 for i in range(70)]
    assert run(first, "plain", plain).num_cache_written_tokens == ()
    output = run(first, "asked", asked, CacheBreakpoint(50, 3600))
    assert output.num_cache_written_tokens == (48,)  # up to the breakpoint's block, all computed here
    assert writer.wait_idle(10)
    first.close()
    hashes = hash_token_blocks(first.root_hash, asked, BLOCK, b"t")
    on_disk = [segment_key(NS, b"t", hashes[i]) for i in (1, 2)]  # [0, 32) and the tail [32, 48)
    assert disk.contains(on_disk) == [True, True] and len(list(tmp_path.rglob("*.kvs"))) == 2
    plain_hashes = hash_token_blocks(first.root_hash, plain, BLOCK, b"t")
    assert host.contains([segment_key(NS, b"t", plain_hashes[i]) for i in (1, 3)]) == [True, True]
    second, *_ = engine_on(disk)  # a restarted worker: an empty pool and host tier, the same disk
    again = run(second, "again", asked, CacheBreakpoint(50, 3600))
    assert (again.num_cached_tokens, again.num_cache_written_tokens) == (48, (0,))
    second.close()
    third, *_ = engine_on(disk)
    assert run(third, "unasked", asked).num_cached_tokens == 32  # the tail is looked up where asked only
    assert run(third, "plain", plain).num_cached_tokens == 0  # it never went to disk
    third.close()
