"""A decode worker facing a prefill replica that misbehaves: each fault is refused, the reservation is
freed, and the request is recomputed locally (a continuation when the first token already went out).
A header changed in flight after P sealed it (a first token still in the vocabulary, a chunk count still
possible) fails its checksum before its first token goes out, so the whole request is recomputed.

The decode worker is a real process on a tiny random-weight model; the misbehaving prefill replica is a
fake gRPC server in this process (the seam: only the KV transfer protocol is faked). The fake always
answers FIRST_TOKEN, so every stream that gets past the header must be FIRST_TOKEN followed by the
model's greedy continuation of PROMPT + [FIRST_TOKEN], which the same worker computes colocated. The KV
it ships is PROMPT's real KV, computed by an engine in this process on the same model.

The ipc transport's faults come last (a handle the decode worker cannot open makes it use grpc with this
fake for a while): the fake shares PROMPT's KV from this process, so the decode worker opens a handle of
another process, as it would a real prefill replica's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from services.common.manifest import load_verified_manifest
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.kvtransfer.chunks import Layout, checksum, seal_header, to_bytes
from services.kvtransfer.ipc_transport import kv_checksum, share
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2_grpc, worker_pb2_grpc
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from tests.engine_helpers import make_engine
from tests.stack_helpers import Proc, free_port, run_python, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "faults-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)
LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)
FIRST_TOKEN = 42
PROMPT = [(i * 5) % 120 + 2 for i in range(40)]
NUM_TOKENS = 12
TRANSFER_TIMEOUT_S = 2.0
STALL_LIMIT_S = 30.0  # a stalled fake gives up after this, far past the transfer deadline


@dataclass
class Fault:
    name: str = "none"


class FakePrefill(kv_transfer_pb2_grpc.PrefillServicer):
    """Answers with a well-formed header and then breaks the promise that `fault.name` says."""

    def __init__(self, fingerprint: str, fault: Fault, prompt_kv: torch.Tensor) -> None:
        self.fingerprint = fingerprint
        self.fault = fault
        self.prompt_kv = prompt_kv  # [num_layers, len(PROMPT), 2, num_kv_heads, head_dim]
        self.calls = 0
        # Per stalled call: the deadline it came with (s), and whether the caller ended it before
        # STALL_LIMIT_S (a deadline or a cancel; False: the fake gave up first).
        self.stall_deadlines: list[float | None] = []
        self.stalls_ended_by_caller: list[bool] = []
        self.transports: list[str] = []  # each call's, in order
        self.shared: list[torch.Tensor] = []  # what the fake's ipc handles point into, kept alive
        self.dead_handle: kvpb.IpcSlice | None = None  # the "dead_producer" fault's handle

    def Prefill(
        self, request: kvpb.PrefillRequest, context: grpc.ServicerContext
    ) -> Iterator[kvpb.PrefillResponse]:
        self.calls += 1
        self.transports.append(request.transport)
        fault = self.fault.name
        num_kv = len(request.prompt_token_ids) - request.num_skip_tokens
        if fault == "garbage":
            yield kvpb.PrefillResponse(chunk=kvpb.KVChunk(index=0, data=b"\x00" * 7))
            return
        header = kvpb.PrefillHeader(
            model_fingerprint="another-model" if fault == "fingerprint" else self.fingerprint,
            layout=LAYOUT.to_proto(),
            first_token=pb.TokenLogprob(
                token_id=1 << 30 if fault == "first_token_outside_vocab" else FIRST_TOKEN
            ),
            num_prompt_tokens=len(request.prompt_token_ids),
            first_token_position=request.num_skip_tokens,
            num_kv_tokens=1 << 40 if fault == "huge_kv" else num_kv,  # a header D must not allocate for
            num_chunks=1 if fault != "block_count" else 2,
        )
        seal_header(header)  # a lying P seals its lies; the faults below change the header in flight
        if fault == "altered_first_token":  # still in the vocabulary: only the checksum tells
            header.first_token.token_id = FIRST_TOKEN + 1
        if fault == "altered_block_count":  # still a possible count: only the checksum tells
            header.num_chunks = 2
        yield kvpb.PrefillResponse(header=header)
        if fault == "stall":  # hold the call open until the caller ends it
            ended = threading.Event()
            context.add_callback(ended.set)
            self.stall_deadlines.append(context.time_remaining())
            self.stalls_ended_by_caller.append(ended.wait(STALL_LIMIT_S))
            return
        assert request.prompt_token_ids == PROMPT
        if request.transport == "ipc":
            yield kvpb.PrefillResponse(chunk=self._ipc_chunk(request, num_kv, fault))
            return
        data = to_bytes(self.prompt_kv[:, request.num_skip_tokens :])
        crc = checksum(data) ^ (1 if fault == "checksum" else 0)
        yield kvpb.PrefillResponse(
            chunk=kvpb.KVChunk(
                index=0, start_token=request.num_skip_tokens, num_tokens=num_kv, data=data, crc32=crc
            )
        )

    def _ipc_chunk(self, request: kvpb.PrefillRequest, num_kv: int, fault: str) -> kvpb.KVChunk:
        """PROMPT's KV shared from this process, as the ipc transport sends it (one chunk)."""
        kv = self.prompt_kv[:, request.num_skip_tokens :].contiguous()
        self.shared.append(kv)
        wire = kv.view(torch.uint8).reshape(-1)
        handle = share(wire)
        if fault == "dead_producer":
            assert self.dead_handle is not None
            handle.shm.CopyFrom(self.dead_handle.shm)
        handle.first_token, handle.num_tokens = request.num_skip_tokens, num_kv
        return kvpb.KVChunk(
            index=0,
            start_token=request.num_skip_tokens,
            num_tokens=num_kv,
            ipc=handle,
            device_checksum=kv_checksum(wire) ^ (1 if fault == "checksum" else 0),
        )


@dataclass
class Rig:
    decode: worker_pb2_grpc.WorkerStub
    fake: FakePrefill
    fake_address: str


def prompt_kv(model: Path) -> torch.Tensor:
    """PROMPT's KV as a sound prefill replica computes it: an engine in this process, same model."""
    engine = make_engine(model, "float32", block_size=LAYOUT.block_size, kv_cache_memory_mb=8)
    params = SamplingParams(temperature=0.0, max_tokens=2)  # more than one token: the KV is exported
    engine.add_request("kv", PROMPT, params, export_kv_from=0)
    (out,) = engine.step()
    assert out.kv is not None and out.kv.start_token == 0
    return out.kv.kv  # [num_layers, len(PROMPT), 2, num_kv_heads, head_dim]


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    fingerprint = load_verified_manifest(model).model_fingerprint
    fake = FakePrefill(fingerprint, Fault(), prompt_kv(model))
    # torch forks its shared-memory manager on the first share: here, before the fake's server threads
    # run (a fork from a busy threaded process crashed in the child once), as a worker does at start
    share(torch.zeros(1, dtype=torch.uint8))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    kv_transfer_pb2_grpc.add_PrefillServicer_to_server(fake, server)
    fake_address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(fake_address)
    server.start()
    env = stack_env(
        TOKEN,
        KVRELAY_MODEL__DTYPE="float32",
        KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8",
        KVRELAY_DISAGGREGATION__TRANSFER_TIMEOUT_MS=str(int(TRANSFER_TIMEOUT_S * 1000)),
    )
    address = f"127.0.0.1:{free_port()}"
    logs = tmp_path_factory.mktemp("faults-logs")
    proc = Proc(
        [
            "worker",
            "--model",
            str(model),
            "--role",
            "decode",
            "--port",
            address.split(":")[1],
            "--threads",
            "1",
        ],
        env,
        logs / "decode.log",
    )
    try:
        wait_serving(address, proc)
        yield Rig(worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address)), fake, fake_address)
    finally:
        proc.stop()
        server.stop(0)


def run(
    rig: Rig,
    rid: str,
    remote: bool,
    prompt: list[int] = PROMPT,
    num_tokens: int = NUM_TOKENS,
    transport: str = "",
) -> tuple[list[int], pb.GenerateResponse]:
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    request = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params))
    if remote:
        request.remote_prefill.address = rig.fake_address
        request.remote_prefill.transport = transport
    tokens: list[int] = []
    last = pb.GenerateResponse()
    for response in rig.decode.Generate(request, metadata=MD, timeout=60):
        tokens.extend(response.token_ids)
        last = response
    return tokens, last


def assert_idle(rig: Rig) -> pb.LoadResponse:
    for _ in range(100):
        load = rig.decode.Load(pb.LoadRequest(), metadata=MD)
        if load.running == load.waiting == load.kv_blocks.active == 0:
            return load
        time.sleep(0.05)
    raise AssertionError(f"decode replica still holds work: {load}")


def stall_outcomes(fake: FakePrefill, num_stalls: int) -> list[bool]:
    """`fake.stalls_ended_by_caller` once it holds `num_stalls` entries (its handler thread records
    each one as the call ends)."""
    give_up = time.monotonic() + STALL_LIMIT_S + 10
    while len(fake.stalls_ended_by_caller) < num_stalls:
        if time.monotonic() > give_up:
            pytest.fail(f"the fake recorded no end of stall {num_stalls} within {STALL_LIMIT_S + 10} s")
        time.sleep(0.05)
    return fake.stalls_ended_by_caller


@pytest.mark.parametrize(
    "fault",
    [
        "fingerprint",
        "garbage",
        "huge_kv",
        "first_token_outside_vocab",
        "altered_first_token",
        "altered_block_count",
    ],
)
def test_fault_before_the_first_token_recomputes_the_whole_request(rig: Rig, fault: str) -> None:
    want, _ = run(rig, f"local-{fault}", remote=False)
    before = assert_idle(rig).prefill_fallbacks_total
    rig.fake.fault.name = fault
    got, last = run(rig, f"remote-{fault}", remote=True)
    assert got == want
    assert last.prefill_mode == pb.PREFILL_MODE_FALLBACK and last.kv_transfer_bytes == 0
    assert assert_idle(rig).prefill_fallbacks_total == before + 1


@pytest.fixture(scope="module")
def continued(rig: Rig) -> list[int]:
    """The stream a request must give once FIRST_TOKEN went out: FIRST_TOKEN, then the model's greedy
    continuation of PROMPT + [FIRST_TOKEN], computed colocated on the same decode worker."""
    own_first, _ = run(rig, "own-first", remote=False, num_tokens=1)
    assert own_first != [FIRST_TOKEN], "the model's own first token must differ from the fake's"
    rest, _ = run(rig, "continuation", remote=False, prompt=[*PROMPT, FIRST_TOKEN], num_tokens=NUM_TOKENS - 1)
    return [FIRST_TOKEN, *rest]


@pytest.mark.parametrize("fault", ["checksum", "block_count"])
def test_fault_after_the_first_token_continues_from_it_locally(
    rig: Rig, continued: list[int], fault: str
) -> None:
    before = assert_idle(rig).prefill_fallbacks_total
    rig.fake.fault.name = fault
    got, last = run(rig, f"cont-{fault}", remote=True)
    assert got == continued, "the first token went out; the rest continues from it"
    assert last.prefill_mode == pb.PREFILL_MODE_FALLBACK and last.kv_transfer_bytes == 0
    assert assert_idle(rig).prefill_fallbacks_total == before + 1


def test_transfer_deadline_ends_a_stall_and_the_stream_continues_locally(
    rig: Rig, continued: list[int]
) -> None:
    before = assert_idle(rig).prefill_fallbacks_total
    num_stalls = len(rig.fake.stalls_ended_by_caller)
    rig.fake.fault.name = "stall"
    got, last = run(rig, "cont-stall", remote=True)
    assert got == continued, "the first token went out; the rest continues from it"
    assert last.prefill_mode == pb.PREFILL_MODE_FALLBACK and last.kv_transfer_bytes == 0
    assert assert_idle(rig).prefill_fallbacks_total == before + 1
    assert stall_outcomes(rig.fake, num_stalls + 1)[num_stalls:] == [True], "the stall was never ended"
    # The call carried the transfer deadline, not the client's 60 s (grpc-timeout may round it up a little;
    # time spent before the fake read it only lowers it).
    deadline = rig.fake.stall_deadlines[num_stalls]
    assert deadline is not None and deadline < 2 * TRANSFER_TIMEOUT_S, f"Prefill's deadline: {deadline}"


def test_sound_transfer_from_the_fake_is_installed(rig: Rig, continued: list[int]) -> None:
    rig.fake.fault.name = "none"
    got, last = run(rig, "sound", remote=True)
    assert got == continued, "decoding from the received KV must equal recomputing it"
    assert last.prefill_mode == pb.PREFILL_MODE_REMOTE and last.kv_transfer_bytes > 0
    assert_idle(rig)


def test_client_gone_during_a_stalled_transfer_frees_the_reservation(rig: Rig) -> None:
    rig.fake.fault.name = "stall"
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    request = pb.GenerateRequest(
        request_id="gone", prompt_token_ids=PROMPT, sampling=sampling_to_proto(params)
    )
    request.remote_prefill.address = rig.fake_address
    call = rig.decode.Generate(request, metadata=MD, timeout=60)
    first = next(iter(call))
    assert list(first.token_ids) == [FIRST_TOKEN]
    call.cancel()
    assert_idle(rig)


def test_ipc_transfer_from_another_process_is_installed(rig: Rig, continued: list[int]) -> None:
    rig.fake.fault.name = "none"
    got, last = run(rig, "ipc-sound", remote=True, transport="ipc")
    assert got == continued, "decoding from the KV copied out of the handle must equal recomputing it"
    assert last.prefill_mode == pb.PREFILL_MODE_REMOTE and last.kv_transport == "ipc"
    assert rig.fake.transports[-1] == "ipc" and last.kv_transfer_bytes > 0
    assert_idle(rig)


def test_ipc_checksum_mismatch_continues_locally(rig: Rig, continued: list[int]) -> None:
    before = assert_idle(rig).prefill_fallbacks_total
    rig.fake.fault.name = "checksum"
    got, last = run(rig, "ipc-checksum", remote=True, transport="ipc")
    assert got == continued, "the first token went out; the rest continues from it"
    assert last.prefill_mode == pb.PREFILL_MODE_FALLBACK and last.kv_transfer_bytes == 0
    assert assert_idle(rig).prefill_fallbacks_total == before + 1


def test_ipc_handle_of_a_dead_producer_is_pulled_again_over_grpc(rig: Rig, continued: list[int]) -> None:
    producer = """
import sys, torch
from services.kvtransfer.ipc_transport import share
sys.stdout.buffer.write(share(torch.zeros(1 << 20, dtype=torch.uint8)).SerializeToString())
"""
    rig.fake.dead_handle = kvpb.IpcSlice.FromString(run_python(producer))  # that producer has exited
    before = assert_idle(rig).prefill_fallbacks_total
    rig.fake.fault.name = "dead_producer"
    got, last = run(rig, "ipc-dead", remote=True, transport="ipc")
    assert got == continued, "the KV pulled again over grpc must equal recomputing it"
    assert rig.fake.transports[-2:] == ["ipc", "grpc"]
    assert last.prefill_mode == pb.PREFILL_MODE_REMOTE and last.kv_transport == "grpc"
    assert assert_idle(rig).prefill_fallbacks_total == before, "pulled again, not recomputed"
    # The decode worker remembers: its next ipc request to this prefill replica goes over grpc at once.
    got, last = run(rig, "ipc-after-dead", remote=True, transport="ipc")
    assert got == continued and rig.fake.transports[-1] == "grpc" and last.kv_transport == "grpc"
    assert_idle(rig)
