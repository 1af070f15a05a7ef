"""Disaggregated serving of the GGUF blocks with int8 activations, whose KV cache is fp16 by default
(engine.kv_cache_dtype auto), between real processes: P prefills into its fp16 cache, the KV crosses to D
as fp16 over gRPC bytes and over the ipc transport's shared memory, never widened, and D decodes on from
it. Greedy tokens must equal a colocated worker's on the same settings (tests/integration/
test_disaggregation.py has the fp32 stack, the fault cases and the stack itself)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from tests.integration.test_disaggregation import MD, PDStack, generate, prompts  # noqa: F401 (fixture)
from tests.stack_helpers import wait_idle

pytestmark = pytest.mark.model

FP16_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2  # SmolLM2: layers x (K, V) x kv heads x head_dim x 2 bytes


@pytest.fixture(scope="module")
def pd16(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDStack]:
    stack = PDStack(model_dir, tmp_path_factory.mktemp("pd16-logs"), KVRELAY_MODEL__WEIGHTS="gguf-int8")
    yield stack
    stack.stop()


def test_every_worker_serves_fp16_kv_under_a_fingerprint_of_its_own(pd16: PDStack) -> None:
    names = ("prefill", "decode", "colocated")
    infos = [pd16.stub(name).Info(pb.InfoRequest(), metadata=MD) for name in names]
    assert {info.kv_bytes_per_token for info in infos} == {FP16_BYTES_PER_TOKEN}
    assert len({info.model_fingerprint for info in infos}) == 1
    assert infos[0].model_fingerprint != infos[0].directory_fingerprint


@pytest.mark.parametrize(("router", "transport"), [("router", "grpc"), ("router-ipc", "ipc")])
def test_fp16_kv_crosses_and_decodes_like_colocated(
    pd16: PDStack,
    prompts: dict[str, list[int]],  # noqa: F811 (the fixture imported above)
    router: str,
    transport: str,
) -> None:
    for i, name in enumerate(("chat-short", "raw-long")):
        # a token of its own per transport: no side holds this prompt's prefix yet, so P sends it all
        prompt = [prompts[name][0], 300 + 10 * i + len(transport), *prompts[name][1:]]
        rid = f"fp16-{transport}-{name}"
        got, last = generate(pd16.stub(router), rid, prompt)
        want, _ = generate(pd16.stub("colocated"), rid, prompt)
        assert got == want, f"{rid}: disaggregated tokens differ from colocated"
        assert last.prefill_mode == pb.PREFILL_MODE_REMOTE, f"{rid}: fell back\n{pd16.fallbacks()}"
        assert last.kv_transport == transport, rid
        # fp16 bytes for (nearly) the whole prompt: fp32 KV would have been twice as many bytes
        sent_tokens, rest = divmod(last.kv_transfer_bytes, FP16_BYTES_PER_TOKEN)
        assert rest == 0 and len(prompt) - 48 < sent_tokens <= len(prompt), (rid, last.kv_transfer_bytes)
    wait_idle(pd16.stub("prefill"), MD)
    wait_idle(pd16.stub("decode"), MD)
