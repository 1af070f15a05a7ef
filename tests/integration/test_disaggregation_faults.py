"""A decode worker facing a prefill replica that misbehaves: each fault is refused, the reservation is
freed, and the request is recomputed locally (a continuation when the first token already went out).

The decode worker is a real process on a tiny random-weight model; the misbehaving prefill replica is a
fake gRPC server in this process (the seam: only the KV transfer protocol is faked).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
import torch

from services.common.manifest import load_verified_manifest
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.kvtransfer.chunks import Layout, checksum
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2 as kvpb
from services.proto_gen.kvrelay.v1 import kv_transfer_pb2_grpc, worker_pb2_grpc
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from tests.stack_helpers import Proc, free_port, stack_env, wait_serving
from tests.tiny_model import make_tiny_llama

TOKEN = "faults-token"
MD = (("authorization", f"Bearer {TOKEN}"),)
LAYOUT = Layout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)
FIRST_TOKEN = 42
PROMPT = [(i * 5) % 120 + 2 for i in range(40)]


@dataclass
class Fault:
    name: str = "none"


class FakePrefill(kv_transfer_pb2_grpc.PrefillServicer):
    """Answers with a well-formed header and then breaks the promise that `fault.name` says."""

    def __init__(self, fingerprint: str, fault: Fault) -> None:
        self.fingerprint = fingerprint
        self.fault = fault
        self.calls = 0

    def Prefill(
        self, request: kvpb.PrefillRequest, context: grpc.ServicerContext
    ) -> Iterator[kvpb.PrefillResponse]:
        self.calls += 1
        fault = self.fault.name
        num_kv = len(request.prompt_token_ids) - request.num_skip_tokens
        if fault == "garbage":
            yield kvpb.PrefillResponse(chunk=kvpb.KVChunk(index=0, data=b"\x00" * 7))
            return
        header = kvpb.PrefillHeader(
            model_fingerprint="another-model" if fault == "fingerprint" else self.fingerprint,
            layout=LAYOUT.to_proto(),
            first_token=pb.TokenLogprob(token_id=FIRST_TOKEN),
            num_prompt_tokens=len(request.prompt_token_ids),
            first_token_position=request.num_skip_tokens,
            num_kv_tokens=num_kv,
            num_chunks=1 if fault != "block_count" else 2,
        )
        yield kvpb.PrefillResponse(header=header)
        if fault == "stall":
            time.sleep(6.0)  # past the decode side's transfer deadline
            return
        data = torch.zeros(2, num_kv, 2, 2, 16).view(torch.uint8).numpy().tobytes()
        crc = checksum(data) ^ (1 if fault == "checksum" else 0)
        yield kvpb.PrefillResponse(
            chunk=kvpb.KVChunk(
                index=0, start_token=request.num_skip_tokens, num_tokens=num_kv, data=data, crc32=crc
            )
        )


@dataclass
class Rig:
    decode: worker_pb2_grpc.WorkerStub
    fake: FakePrefill
    fake_address: str


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    model = make_tiny_llama(tmp_path_factory.mktemp("tiny"))
    fingerprint = load_verified_manifest(model).model_fingerprint
    fake = FakePrefill(fingerprint, Fault())
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    kv_transfer_pb2_grpc.add_PrefillServicer_to_server(fake, server)
    fake_address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(fake_address)
    server.start()
    env = stack_env(
        TOKEN,
        KVRELAY_MODEL__DTYPE="float32",
        KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="8",
        KVRELAY_DISAGGREGATION__TRANSFER_TIMEOUT_MS="2000",
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


def run(rig: Rig, rid: str, remote: bool) -> tuple[list[int], pb.GenerateResponse]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    request = pb.GenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=sampling_to_proto(params))
    if remote:
        request.remote_prefill.address = rig.fake_address
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


@pytest.mark.parametrize("fault", ["fingerprint", "garbage"])
def test_fault_before_the_first_token_recomputes_the_whole_request(rig: Rig, fault: str) -> None:
    want, _ = run(rig, f"local-{fault}", remote=False)
    before = assert_idle(rig).prefill_fallbacks_total
    rig.fake.fault.name = fault
    got, last = run(rig, f"remote-{fault}", remote=True)
    assert got == want
    assert last.prefill_mode == pb.PREFILL_MODE_FALLBACK and last.kv_transfer_bytes == 0
    assert assert_idle(rig).prefill_fallbacks_total == before + 1


@pytest.mark.parametrize("fault", ["checksum", "block_count", "stall"])
def test_fault_after_the_first_token_continues_from_it_locally(rig: Rig, fault: str) -> None:
    before = assert_idle(rig).prefill_fallbacks_total
    rig.fake.fault.name = fault
    started = time.monotonic()
    got, last = run(rig, f"cont-{fault}", remote=True)
    assert got[0] == FIRST_TOKEN and len(got) == 12, "the first token went out; the rest continues from it"
    assert last.prefill_mode == pb.PREFILL_MODE_FALLBACK
    assert assert_idle(rig).prefill_fallbacks_total == before + 1
    if fault == "stall":
        assert time.monotonic() - started < 5.5, "the transfer deadline must cut the stall short"


def test_sound_transfer_from_the_fake_is_installed(rig: Rig) -> None:
    rig.fake.fault.name = "none"
    got, last = run(rig, "sound", remote=True)
    assert got[0] == FIRST_TOKEN and len(got) == 12
    assert last.prefill_mode == pb.PREFILL_MODE_REMOTE and last.kv_transfer_bytes > 0
    assert_idle(rig)


def test_client_gone_during_a_stalled_transfer_frees_the_reservation(rig: Rig) -> None:
    rig.fake.fault.name = "stall"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    request = pb.GenerateRequest(
        request_id="gone", prompt_token_ids=PROMPT, sampling=sampling_to_proto(params)
    )
    request.remote_prefill.address = rig.fake_address
    call = rig.decode.Generate(request, metadata=MD, timeout=60)
    first = next(iter(call))
    assert list(first.token_ids) == [FIRST_TOKEN]
    call.cancel()
    assert_idle(rig)
