"""Prefill and decode as separate processes on the real model, against a colocated worker.

Processes: a prefill worker (P), a decode worker (D), a router over both (R), and a colocated worker (C)
as the reference. Every request through R is prefilled on P, its KV shipped over gRPC to D (or, through a
second router, over the ipc transport's shared memory), and decoded there; the same request on C runs in
one engine. Greedy fp32 tokens must be identical, with KV bytes
actually transferred and no fallback. Then: a cancel storm, and P killed under load.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import grpc
import pytest

from services.codec.text.chat_template import chat_template_from_tokenizer, render_and_encode
from services.codec.text.tokenizer import Tokenizer
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.reference_prompts import long_text
from tests.stack_helpers import Proc, free_port, stack_env, wait_idle, wait_serving

TOKEN = "pd-test-token-0123456789"
MD = (("authorization", f"Bearer {TOKEN}"),)


class PDStack:
    def __init__(self, model_dir: Path, logs: Path, **settings: str) -> None:
        """`settings`: more KVRELAY_* variables for every process (another weights or KV setting)."""
        env = stack_env(
            TOKEN,
            KVRELAY_MODEL__DTYPE="float32",
            KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="256",
            KVRELAY_ENGINE__MAX_MODEL_LEN="4096",
            KVRELAY_DISAGGREGATION__POLICY="always",  # remote prefill forced, whatever the estimates say
            # Tokens and transports are checked here, not speed: a 1,500-token prompt on one thread of a
            # loaded 2-core CI machine must not fall back for slowness (the default is 30 s).
            KVRELAY_DISAGGREGATION__TRANSFER_TIMEOUT_MS="240000",
            # The workers expect ipc (router-ipc uses it), so P starts torch's shared-memory manager at
            # start: started by the first transfer instead, it forks from a gRPC thread, which on a loaded
            # machine left it unanswering ("no response from torch_shm_manager") and the transfer fell back.
            KVRELAY_DISAGGREGATION__TRANSPORT="ipc",
            **settings,
        )
        self.addresses = {name: f"127.0.0.1:{free_port()}" for name in ("prefill", "decode", "colocated")}
        self.workers = {
            name: Proc(
                [
                    "worker",
                    "--model",
                    str(model_dir),
                    "--role",
                    name,
                    "--port",
                    address.split(":")[1],
                    "--threads",
                    "1",
                    "--name",
                    name,
                ],
                env,
                logs / f"{name}.log",
            )
            for name, address in self.addresses.items()
        }
        # Two routers over the same pools: one sends the KV over grpc, the other over ipc.
        self.router_addresses = {name: f"127.0.0.1:{free_port()}" for name in ("router", "router-ipc")}
        pool = ",".join([self.addresses["prefill"], self.addresses["decode"]])
        self.routers = {
            name: Proc(
                ["router", "--port", address.split(":")[1], "--workers", pool],
                {**env, "KVRELAY_DISAGGREGATION__TRANSPORT": "ipc" if name == "router-ipc" else "grpc"},
                logs / f"{name}.log",
            )
            for name, address in self.router_addresses.items()
        }
        self.router_address = self.router_addresses["router"]
        for name, proc in self.workers.items():
            wait_serving(self.addresses[name], proc)
        for name, proc in self.routers.items():
            wait_serving(self.router_addresses[name], proc)
            self._wait_router_sees_both_pools(self.router_addresses[name])

    def stub(self, name: str) -> worker_pb2_grpc.WorkerStub:
        address = self.router_addresses.get(name) or self.addresses[name]
        return worker_pb2_grpc.WorkerStub(grpc.insecure_channel(address))

    def _wait_router_sees_both_pools(self, address: str) -> None:
        status = worker_pb2_grpc.RouterStub(grpc.insecure_channel(address))
        for _ in range(100):
            replicas = status.Replicas(pb.ReplicasRequest(), metadata=MD).replicas
            if sorted(r.role for r in replicas if r.ready) == ["decode", "prefill"]:
                return
            time.sleep(0.2)
        raise TimeoutError("the router never saw a ready prefill and decode replica")

    def fallbacks(self) -> str:
        """What D logged about remote prefills it gave up on or moved off ipc: a failure message's why."""
        lines = self.workers["decode"].log_path.read_text(errors="replace").splitlines()
        return "\n".join(line for line in lines if "remote prefill failed" in line or "ipc handle" in line)

    def wait_prefill_ejected(self) -> None:
        status = worker_pb2_grpc.RouterStub(grpc.insecure_channel(self.router_address))
        for _ in range(100):
            replicas = status.Replicas(pb.ReplicasRequest(), metadata=MD).replicas
            if not any(r.ready and r.role == "prefill" for r in replicas):
                return
            time.sleep(0.1)
        raise TimeoutError("the router still uses the dead prefill replica")

    def stop(self) -> None:
        for proc in [*self.routers.values(), *self.workers.values()]:
            proc.stop()


@pytest.fixture(scope="module")
def pd(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    stack = PDStack(model_dir, tmp_path_factory.mktemp("pd-logs"))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> dict[str, list[int]]:
    tokenizer = Tokenizer.from_dir(model_dir)
    template = chat_template_from_tokenizer(tokenizer)
    question = "Summarize this text in two sentences.\n\n"

    def chat(text: str) -> list[int]:
        return render_and_encode(template, tokenizer, [{"role": "user", "content": text}])

    out = {
        "chat-short": chat("What is the capital of France?"),
        "raw-short": tokenizer.encode("The capital of France is", add_special_tokens=True),
        "chat-long": chat(question + long_text(88, 1)),
        "raw-long": tokenizer.encode(long_text(88, 2), add_special_tokens=True),
    }
    assert len(out["chat-long"]) > 1500 and len(out["raw-long"]) > 1500
    return out


def generate(stub: worker_pb2_grpc.WorkerStub, rid: str, prompt: list[int], **sampling: object
             ) -> tuple[list[int], pb.GenerateResponse]:  # fmt: skip
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": 24, "ignore_eos": True, **sampling})  # type: ignore[arg-type]
    request = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params))
    tokens: list[int] = []
    last = pb.GenerateResponse()
    for response in stub.Generate(request, metadata=MD, timeout=300):
        tokens.extend(response.token_ids)
        last = response
    return tokens, last


def test_remote_prefill_matches_colocated_token_for_token(pd: PDStack, prompts: dict[str, list[int]]) -> None:
    router, colocated = pd.stub("router"), pd.stub("colocated")
    for name in ("chat-short", "raw-short", "chat-long", "raw-long"):
        for turn in ("cold", "warm"):  # the second time, the prefix caches (P's and D's) hit
            rid = f"{name}-{turn}"
            got, last = generate(router, rid, prompts[name])
            want, _ = generate(colocated, rid, prompts[name])
            assert got == want, f"{rid}: disaggregated tokens differ from colocated"
            assert last.prefill_mode == pb.PREFILL_MODE_REMOTE, (
                f"{rid}: fell back or ran locally\n{pd.fallbacks()}"
            )
            # The shipping alone (what the router learns bandwidth from) is part of the whole transfer.
            assert 0 < last.kv_link_seconds < last.kv_transfer_seconds, rid
            sent_tokens = last.kv_transfer_bytes // (30 * 2 * 3 * 64 * 4)  # SmolLM2: fp32 KV per token
            if turn == "cold":  # D may hold the chat template's shared opening already
                assert 0 < len(prompts[name]) - sent_tokens < 48 or sent_tokens == len(prompts[name])
            else:
                assert 0 < sent_tokens <= 16, "D's cached prefix must not be sent again"
                assert last.num_cached_tokens >= len(prompts[name]) - 16


def test_ipc_transport_matches_colocated_token_for_token(pd: PDStack, prompts: dict[str, list[int]]) -> None:
    """P and D are two processes on one host: the KV crosses as a shared-memory handle, not as bytes."""
    router, colocated = pd.stub("router-ipc"), pd.stub("colocated")
    for name in ("raw-long",):
        prompt = [prompts[name][0], 300, *prompts[name][1:]]  # a token of its own: P computes it all
        for turn in ("cold", "warm"):
            rid = f"ipc-{name}-{turn}"
            got, last = generate(router, rid, prompt)
            want, _ = generate(colocated, rid, prompt)
            assert got == want, f"{rid}: disaggregated tokens differ from colocated"
            assert last.prefill_mode == pb.PREFILL_MODE_REMOTE, (
                f"{rid}: fell back or ran locally\n{pd.fallbacks()}"
            )
            assert last.kv_transport == "ipc" and last.kv_transfer_bytes > 0, rid
    _, last = generate(pd.stub("router"), "grpc-router", prompts["chat-short"])
    assert last.prefill_mode == pb.PREFILL_MODE_REMOTE and last.kv_transport == "grpc"
    wait_idle(pd.stub("prefill"), MD)
    wait_idle(pd.stub("decode"), MD)


def test_seeded_sampling_is_the_same_colocated_and_disaggregated(
    pd: PDStack, prompts: dict[str, list[int]]
) -> None:
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 4242, "max_tokens": 32}
    got, last = generate(pd.stub("router"), "seeded", prompts["chat-short"], **sampling)
    want, _ = generate(pd.stub("colocated"), "seeded", prompts["chat-short"], **sampling)
    assert got == want and last.prefill_mode == pb.PREFILL_MODE_REMOTE


STORM_TOKENS = 400
NUM_IN_PREFILL = 2  # long prompts: D reserves room for each one's KV while P computes it
NUM_IN_DECODE = 12


class StreamingCall(Iterator[pb.GenerateResponse], Protocol):
    def cancel(self) -> bool: ...


def storm_call(router: worker_pb2_grpc.WorkerStub, rid: str, prompt: list[int]) -> StreamingCall:
    params = SamplingParams(temperature=0.0, max_tokens=STORM_TOKENS, ignore_eos=True)
    request = pb.GenerateRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling_to_proto(params))
    return router.Generate(request, metadata=MD, timeout=120)


def wait_in_prefill(prefill: worker_pb2_grpc.WorkerStub, num: int, idle: pb.LoadResponse) -> None:
    """Until P holds `num` requests and has sampled no token since `idle`: every one is in prefill."""
    deadline = time.monotonic() + 60
    load = idle
    while time.monotonic() < deadline:
        load = prefill.Load(pb.LoadRequest(), metadata=MD)
        assert load.generation_tokens_total == idle.generation_tokens_total, "a prefill finished first"
        if load.running + load.waiting == num:
            return
        time.sleep(0.01)
    pytest.fail(f"P never held the {num} requests in prefill: {load}")


def test_cancel_storm_frees_everything_on_both_sides(pd: PDStack, prompts: dict[str, list[int]]) -> None:
    router, prefill, decode = pd.stub("router"), pd.stub("prefill"), pd.stub("decode")
    p0, d0 = wait_idle(prefill, MD), wait_idle(decode, MD)
    long_prompt = prompts["raw-long"]
    # A token of its own right after BOS: no prefix cache holds a block of it, so P computes every token.
    calls = [
        storm_call(router, f"storm-prefill-{i}", [long_prompt[0], 400 + i, *long_prompt[1:]])
        for i in range(NUM_IN_PREFILL)
    ]
    wait_in_prefill(prefill, NUM_IN_PREFILL, p0)
    for call in calls:
        call.cancel()
    p1, d1 = wait_idle(prefill, MD), wait_idle(decode, MD)
    assert p1.requests_aborted_total - p0.requests_aborted_total == NUM_IN_PREFILL, "P aborted them"
    assert p1.generation_tokens_total == p0.generation_tokens_total, "none got as far as a first token"
    assert d1.requests_aborted_total - d0.requests_aborted_total == NUM_IN_PREFILL, "D freed the reservations"
    assert d1.generation_tokens_total == d0.generation_tokens_total

    short_prompt = prompts["chat-short"]
    calls = [
        storm_call(router, f"storm-decode-{i}", [*short_prompt[:-1], 100 + i]) for i in range(NUM_IN_DECODE)
    ]
    for call in calls:  # the first token came from P, which is done with the request: D decodes it
        assert next(call).token_ids
    for call in calls:
        call.cancel()
    p2, d2 = wait_idle(prefill, MD), wait_idle(decode, MD)
    assert p2.requests_aborted_total == p1.requests_aborted_total, "P had handed every one to D"
    assert d2.requests_aborted_total - d1.requests_aborted_total == NUM_IN_DECODE, "D aborted every one"
    num_decoded = d2.generation_tokens_total - d1.generation_tokens_total
    assert num_decoded < NUM_IN_DECODE * STORM_TOKENS // 4, f"D decoded {num_decoded} tokens after cancel"


def test_killing_prefill_under_load_fails_no_request(
    pd: PDStack, prompts: dict[str, list[int]], tmp_path: Path
) -> None:
    router, decode = pd.stub("router"), pd.stub("decode")
    before = decode.Load(pb.LoadRequest(), metadata=MD)
    results: dict[int, tuple[list[int], pb.GenerateResponse] | BaseException] = {}

    def run(i: int) -> None:
        # A token of its own right after BOS: no prefix cache anywhere holds any block of it, so P is
        # still prefilling when it is killed.
        long_prompt = prompts["raw-long"]
        prompt = [long_prompt[0], 200 + i, *long_prompt[1:]]
        try:
            results[i] = generate(router, f"kill-{i}", prompt, max_tokens=48)
        except BaseException as exc:  # reported below
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    prefill = pd.stub("prefill")
    deadline = time.monotonic() + 60
    while prefill.Load(pb.LoadRequest(), metadata=MD).running == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # kill P while it is prefilling
    pd.workers["prefill"].popen.kill()
    for thread in threads:
        thread.join(300)
    failures = {i: r for i, r in results.items() if isinstance(r, BaseException)}
    assert len(results) == 6 and not failures, failures
    modes = [r[1].prefill_mode for r in results.values() if not isinstance(r, BaseException)]
    assert pb.PREFILL_MODE_FALLBACK in modes, "P died mid-prefill: some request must have been recomputed"
    assert set(modes) <= {pb.PREFILL_MODE_REMOTE, pb.PREFILL_MODE_FALLBACK, pb.PREFILL_MODE_LOCAL}
    assert all(len(r[0]) == 48 for r in results.values() if not isinstance(r, BaseException))
    after = wait_idle(decode, MD)
    assert after.prefill_fallbacks_total > before.prefill_fallbacks_total
    pd.wait_prefill_ejected()  # then new requests are prefilled on D
    tokens, last = generate(router, "after-kill", prompts["chat-short"])
    assert len(tokens) == 24 and last.prefill_mode == pb.PREFILL_MODE_LOCAL
