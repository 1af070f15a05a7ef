"""Structured output across the prefill -> decode handoff, with real processes: a prefill worker (P) and a
decode worker (D) on a tiny random-weight Llama that spells with SmolLM2's tokenizer.

P samples the first token under the grammar and ships the KV; D builds its own matcher, advances it past
that token, and decodes on. Seeded, the tokens equal D computing the whole request itself, and they spell
JSON that fits the schema. A grammar complete at P's token ends there; one that does not compile is
INVALID_ARGUMENT, remote or not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import jsonschema
import pytest
from tokenizers import Tokenizer

from services.common.grammar import GrammarKind, GrammarSpec
from services.common.proto_convert import sampling_to_proto
from services.common.sampling import SamplingParams
from services.proto_gen.kvrelay.v1 import worker_pb2 as pb
from services.proto_gen.kvrelay.v1 import worker_pb2_grpc
from tests.grammar_helpers import decode, make_tiny_smollm2_vocab_llama
from tests.stack_helpers import Proc, free_port, stack_env, wait_idle, wait_serving

pytestmark = pytest.mark.model  # SmolLM2's tokenizer files come from the prepared model directory

TOKEN = "pd-grammar-token"
MD = (("authorization", f"Bearer {TOKEN}"),)
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"enum": ["S", "M", "L"]},
        "parts": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}},
    },
    "required": ["name", "size"],
    "additionalProperties": False,
}


class PDPair:
    def __init__(self, model: Path, logs: Path) -> None:
        env = stack_env(TOKEN, KVRELAY_MODEL__DTYPE="float32", KVRELAY_ENGINE__KV_CACHE_MEMORY_MB="16")
        self.addresses = {role: f"127.0.0.1:{free_port()}" for role in ("prefill", "decode")}
        self.workers = {role: self._worker(model, role, env, logs) for role in self.addresses}
        for role, proc in self.workers.items():
            wait_serving(self.addresses[role], proc)
        self.channel = grpc.insecure_channel(self.addresses["decode"])
        self.decode = worker_pb2_grpc.WorkerStub(self.channel)

    def _worker(self, model: Path, role: str, env: dict[str, str], logs: Path) -> Proc:
        port = self.addresses[role].split(":")[1]
        args = ["worker", "--model", str(model), "--role", role, "--port", port, "--threads", "1"]
        return Proc([*args, "--name", role], env, logs / f"{role}.log")

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams, *, remote: bool
                 ) -> tuple[list[int], pb.GenerateResponse]:  # fmt: skip
        request = pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=sampling_to_proto(params)
        )
        if remote:
            request.remote_prefill.address = self.addresses["prefill"]
        tokens: list[int] = []
        last = pb.GenerateResponse()
        for response in self.decode.Generate(request, metadata=MD, timeout=120):
            tokens.extend(response.token_ids)
            last = response
        return tokens, last

    def stop(self) -> None:
        self.channel.close()
        for proc in self.workers.values():
            proc.stop()


@pytest.fixture(scope="module")
def tiny_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_smollm2_vocab_llama(tmp_path_factory.mktemp("tiny-smollm2-vocab"), model_dir)


@pytest.fixture(scope="module")
def pair(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDPair]:
    stack = PDPair(tiny_dir, tmp_path_factory.mktemp("pd-grammar-logs"))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))


def test_decode_continues_the_grammar_from_the_prefill_replicas_token(
    pair: PDPair, tokenizer: Tokenizer
) -> None:
    prompt = list(tokenizer.encode("Describe a part as JSON:").ids)
    for seed in range(4):
        params = SamplingParams(
            temperature=1.0, seed=seed, max_tokens=64, grammar=GrammarSpec.json_schema(SCHEMA)
        )
        got, last = pair.generate(f"remote-{seed}", prompt, params, remote=True)
        assert last.prefill_mode == pb.PREFILL_MODE_REMOTE, f"seed {seed}: fell back or ran locally"
        assert last.finish_reason == pb.FINISH_REASON_STOP
        jsonschema.validate(json.loads(decode(tokenizer, got)), SCHEMA)
        want, _ = pair.generate(f"local-{seed}", prompt, params, remote=False)
        assert got == want, f"seed {seed}: the handoff changed the tokens"
    wait_idle(pair.decode, MD)


def test_a_grammar_complete_at_the_first_token_ends_on_the_prefill_replica(
    pair: PDPair, tokenizer: Tokenizer
) -> None:
    """Every token a one-letter choice allows completes it: P's header says STOP and D decodes nothing."""
    prompt = list(tokenizer.encode("Pick one:").ids)
    for seed in range(3):
        grammar = GrammarSpec.choice(["y", "n"])
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=8, grammar=grammar)
        got, last = pair.generate(f"choice-{seed}", prompt, params, remote=True)
        assert len(got) == 1 and decode(tokenizer, got) in ("y", "n")
        assert last.finish_reason == pb.FINISH_REASON_STOP and last.prefill_mode == pb.PREFILL_MODE_REMOTE
    wait_idle(pair.decode, MD)


def test_a_grammar_that_does_not_compile_is_invalid_argument(pair: PDPair) -> None:
    params = SamplingParams(grammar=GrammarSpec(GrammarKind.REGEX, "[a-"))
    for remote in (True, False):
        with pytest.raises(grpc.RpcError) as caught:
            pair.generate(f"bad-{remote}", [1, 2, 3], params, remote=remote)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_idle(pair.decode, MD)
