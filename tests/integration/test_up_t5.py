"""A tiny T5 served by `kvrelay up --mode disaggregated` (issue 51): the prefill pool runs the encoder and
the first decoder step and ships the encoder output, the decode pool rebuilds the cross KV and loops.
Through the official SDKs (strict): a streamed completion whose text is transformers' greedy output, a
decoder prompt, the chat routes' 400 without a chat template on every protocol, the bad inputs' 400s, and a
cancel storm of 40 streams that leaves no request running and no block (self or cross) held on either
pool. (Colocated serving: tests/integration/test_engine_t5.py and test_generate_cli.py.)"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import grpc
import httpx
import openai
import pytest
import torch

from services.common.manifest import compute_manifest, write_manifest
from services.proto_gen.kvrelay.v1 import public_pb2 as pub
from services.proto_gen.kvrelay.v1 import public_pb2_grpc
from tests.integration.test_up import UpStack, start_up, status_json, wait_until
from tests.ports import free_port
from tests.tiny_t5 import BYTE_OFFSET, byte_tokenizer, make_tiny_t5

MAX_SOURCE = 256  # engine.max_model_len: the longest source, and decoder prompt + output
NUM_TOKENS = 12
NEAR_TIE = 1e-3
CONFIG = (
    f"model:\n  dtype: float32\nengine:\n  kv_cache_memory_mb: 32\n  max_model_len: {MAX_SOURCE}\n"
    "disaggregation:\n  policy: always\n"
    "limits:\n  step_timeout_ms: 30000\n  request_timeout_ms: 6100000\n  max_output_tokens: 200\n"
    "  default_max_output_tokens: 64\n"
)


@pytest.fixture(scope="module")
def t5(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path, reference = make_tiny_t5(tmp_path_factory.mktemp("t5-model"), gated=True, tied=False, seed=3)
    write_manifest(path, compute_manifest(path))
    return path, reference


@pytest.fixture(scope="module")
def grpc_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def stack(
    t5: tuple[Path, Any], grpc_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[UpStack]:
    workdir = tmp_path_factory.mktemp("up-t5")
    flags = ("--mode", "disaggregated", "--grpc-port", str(grpc_port))
    running = start_up(t5[0], workdir, *flags, free_ports=True, config_text=CONFIG)
    yield running
    running.stop()


def client(stack: UpStack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )


def model_name(stack: UpStack) -> str:
    return str(httpx.get(f"{stack.url}/v1/models", timeout=10.0).json()["data"][0]["id"])


def pools(stack: UpStack) -> dict[str, dict[str, Any]]:
    """The prefill and the decode worker's status (one of each)."""
    services = status_json(stack.url)["services"]
    return {s["role"]: s for s in services if s["role"] in ("prefill", "decode")}


def pools_once_counted(
    stack: UpStack, before: dict[str, dict[str, Any]], served: int
) -> dict[str, dict[str, Any]]:
    """The pools' status once the prefill and the decode pool have counted `served` more remote prefills than
    in `before`: the router refreshes each replica's Load about once a second, so the status lags the
    answers. A counter that never grows times the wait out; one that grows past `served` fails the caller's
    equality."""
    now: dict[str, dict[str, Any]] = before

    def counted() -> bool:
        nonlocal now
        now = pools(stack)
        return all(
            now[pool]["remote_prefills_total"] - before[pool]["remote_prefills_total"] >= served
            for pool in ("prefill", "decode")
        )

    wait_until(counted, stack, f"{served} remote prefills not counted on both pools", 30.0)
    return now


def reference_text(reference: Any, source: str, decoder_prompt: str = "") -> str:
    """transformers' greedy continuation of `decoder_prompt` for `source` (EOS banned), as text; the test
    needs every step's top-2 margin over NEAR_TIE (seeds fixed in advance), so any tie-break is exact."""
    tokenizer = byte_tokenizer()
    source_ids = tokenizer.encode(source).ids  # EOS appended, as the codec's tokenizer does
    start = [0, *(b + BYTE_OFFSET for b in decoder_prompt.encode())]
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([source_ids]), decoder_input_ids=torch.tensor([start]), max_new_tokens=NUM_TOKENS,
            min_new_tokens=NUM_TOKENS, do_sample=False, num_beams=1, output_scores=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    margins = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    assert min(margins) > NEAR_TIE, margins
    return str(tokenizer.decode(out.sequences[0, len(start) :].tolist()))


def test_a_streamed_completion_is_transformers_greedy_output(stack: UpStack, t5: tuple[Path, Any]) -> None:
    source = "summarize: the river rose slowly through the night"
    asked: dict[str, Any] = {
        "model": model_name(stack), "prompt": source, "max_tokens": NUM_TOKENS, "temperature": 0,
        "extra_body": {"min_tokens": NUM_TOKENS},
    }  # fmt: skip
    before = pools(stack)
    done = client(stack).completions.create(**asked)
    assert done.choices[0].text == reference_text(t5[1], source)
    usage = done.usage
    assert usage is not None and usage.completion_tokens == NUM_TOKENS
    # the input the model read: the source with its EOS, and the decoder's start token
    assert usage.prompt_tokens == len(source.encode()) + 1 + 1
    # The SDK types a completion chunk's finish_reason as required, so its strict mode refuses the null
    # every chunk but the last carries (as OpenAI's own streams do): the stream is read leniently, as in
    # tests/e2e/test_openai_sdk.py.
    lenient = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
    chunks = list(lenient.completions.create(**asked, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
    assert len(chunks) > 2 and chunks[-1].choices[0].finish_reason == "length"
    # both went through the split: the prefill pool encoded the source and shipped its output with the
    # KV; the decode pool built the cross KV from it and never ran the encoder
    after = pools_once_counted(stack, before, 2)

    def grew(pool: str, name: str) -> int:
        return int(after[pool][name] - before[pool][name])

    assert grew("prefill", "remote_prefills_total") == grew("decode", "remote_prefills_total") == 2
    assert grew("prefill", "encoded_sequences_total") == 2 and grew("decode", "encoded_sequences_total") == 0
    assert after["decode"]["prefill_fallbacks_total"] == 0


def test_a_decoder_prompt_continues_after_the_start_token(
    stack: UpStack, t5: tuple[Path, Any], grpc_port: int
) -> None:
    source, decoder_prompt = "translate: good morning", "Gu"
    expected = reference_text(t5[1], source, decoder_prompt)
    reply = client(stack).completions.create(
        model=model_name(stack),
        prompt=source,
        max_tokens=NUM_TOKENS,
        temperature=0,
        extra_body={"min_tokens": NUM_TOKENS, "decoder_prompt": decoder_prompt},
    )
    assert reply.choices[0].text == expected
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        request = pub.TextGenerateRequest(
            prompt=source,
            decoder_prompt=decoder_prompt,
            sampling=pub.SamplingOptions(max_tokens=NUM_TOKENS, temperature=0.0, min_tokens=NUM_TOKENS),
        )
        replies = list(public_pb2_grpc.InferenceStub(channel).Generate(request, timeout=60))
    assert "".join(r.text for r in replies) == expected


def test_stop_strings_logprobs_and_structured_output_work_as_for_any_model(
    stack: UpStack, t5: tuple[Path, Any]
) -> None:
    source = "summarize: the river rose slowly through the night"
    expected = reference_text(t5[1], source)
    asked: dict[str, Any] = {
        "model": model_name(stack),
        "prompt": source,
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
    }
    stop = expected[5:7]
    cut = client(stack).completions.create(**asked, stop=[stop], extra_body={"min_tokens": NUM_TOKENS})
    assert cut.choices[0].text == expected[: expected.index(stop)] and cut.choices[0].finish_reason == "stop"
    scored = client(stack).completions.create(**asked, logprobs=2, extra_body={"min_tokens": NUM_TOKENS})
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == NUM_TOKENS and all(value <= 0 for value in logprobs.token_logprobs)
    # the legacy shape keys alternatives by text: bytes of no character of their own all read "\ufffd"
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    shaped = client(stack).completions.create(
        **asked, extra_body={"structured_outputs": {"regex": "[a-z]{6}"}}
    )
    assert re.fullmatch("[a-z]{6}", shaped.choices[0].text), shaped.choices[0].text


def test_chat_without_a_template_is_a_400_on_every_protocol(stack: UpStack, grpc_port: int) -> None:
    model = model_name(stack)
    messages: Any = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(stack).chat.completions.create(model=model, messages=messages, max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client(stack).responses.create(model=model, input="Hi", max_output_tokens=4)
    claude = anthropic.Anthropic(
        base_url=stack.url, api_key="unused", max_retries=0, _strict_response_validation=True
    )
    with pytest.raises(anthropic.BadRequestError, match="no chat template"):
        claude.messages.create(model=model, messages=messages, max_tokens=4)
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        chat = pub.ChatRequest(messages=[pub.ChatMessage(role="user", content="Hi")])
        with pytest.raises(grpc.RpcError) as failure:
            list(public_pb2_grpc.InferenceStub(channel).Chat(chat, timeout=60))
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no chat template" in str(failure.value.details())


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": "x" * MAX_SOURCE}, "prompt", "encoder's source length"),  # + EOS: one over
        ({"prompt": "x", "use_beam_search": True}, "use_beam_search", "beam search"),
        ({"prompt": "x", "best_of": 3}, "best_of", "beam-search"),
        ({"prompt": "x", "decoder_prompt": [0, 999]}, "decoder_prompt", "outside the vocabulary"),
    ],
)
def test_bad_encoder_decoder_input_is_a_400(
    stack: UpStack, body: dict[str, Any], param: str, words: str
) -> None:
    fields = {k: v for k, v in body.items() if k != "prompt"}
    with pytest.raises(openai.BadRequestError) as failure:
        client(stack).completions.create(
            model=model_name(stack), prompt=body["prompt"], max_tokens=4, extra_body=fields
        )
    error = failure.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert words in error["message"]


def test_a_cancel_storm_leaves_nothing_running_or_held(stack: UpStack) -> None:
    model = model_name(stack)

    async def open_and_drop(http: httpx.AsyncClient, index: int) -> None:
        body = {
            "model": model, "prompt": f"story {index}: " + "once upon a time " * (index % 7 + 1),
            "max_tokens": 200, "min_tokens": 200, "stream": True,
        }  # fmt: skip
        async with http.stream("POST", f"{stack.url}/v1/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    return  # the first token came: leave mid-stream

    async def storm() -> None:
        async with httpx.AsyncClient(timeout=120.0) as http:
            await asyncio.gather(*(open_and_drop(http, i) for i in range(40)))

    asyncio.run(storm())

    def idle() -> bool:
        workers = [s for s in status_json(stack.url)["services"] if s["role"] not in ("codec", "router")]
        return bool(workers) and all(s["running"] == 0 and s["kv_blocks"]["active"] == 0 for s in workers)

    wait_until(idle, stack, "workers still hold requests or blocks", 60.0)


def test_a_timeout_rule_without_room_for_the_encoder_is_refused_at_start(
    t5: tuple[Path, Any], tmp_path: Path
) -> None:
    """30 s per step x 200 tokens fills the request timeout exactly: fine for a decoder-only model, but an
    encoder-decoder request's first token also waits for its encoder (limits.encoder_timeout_ms)."""
    tight = CONFIG.replace("request_timeout_ms: 6100000", "request_timeout_ms: 6000000")
    with pytest.raises(RuntimeError, match=r"limits\.encoder_timeout_ms \(30000\)"):
        start_up(t5[0], tmp_path, free_ports=True, config_text=tight).stop()


def test_a_colocated_stack_serves_the_same_text(t5: tuple[Path, Any], tmp_path: Path) -> None:
    """`kvrelay up` without the split: one worker encodes and decodes."""
    colocated = start_up(t5[0], tmp_path, free_ports=True, config_text=CONFIG)
    try:
        source = "summarize: the river rose slowly through the night"
        reply = client(colocated).completions.create(
            model=model_name(colocated), prompt=source, max_tokens=NUM_TOKENS, temperature=0,
            extra_body={"min_tokens": NUM_TOKENS},
        )  # fmt: skip
        assert reply.choices[0].text == reference_text(t5[1], source)

        def worker() -> dict[str, Any]:
            [found] = [
                s for s in status_json(colocated.url)["services"] if s["role"] not in ("codec", "router")
            ]
            assert found["role"] == "colocated"
            return found

        # warm-up and this request (the status lags the answer by up to a Load refresh)
        wait_until(lambda: worker()["encoded_sequences_total"] >= 2, colocated, "not encoded", 30.0)
    finally:
        colocated.stop()


@pytest.mark.parametrize("transport", ["ipc", "torch"])
def test_the_other_transports_carry_the_kv_beside_the_encoder_output(
    t5: tuple[Path, Any], tmp_path: Path, transport: str
) -> None:
    """The decoder's KV over shared memory (ipc) or torch.distributed (gloo on a CPU); the encoder output
    always in the Prefill stream. The decode replica installs both and never encodes."""
    config = CONFIG.replace("policy: always\n", f"policy: always\n  transport: {transport}\n")
    split = start_up(t5[0], tmp_path, "--mode", "disaggregated", free_ports=True, config_text=config)
    try:
        source = "translate: good morning"
        before = pools(split)
        reply = client(split).completions.create(
            model=model_name(split), prompt=source, max_tokens=NUM_TOKENS, temperature=0,
            extra_body={"min_tokens": NUM_TOKENS},
        )  # fmt: skip
        assert reply.choices[0].text == reference_text(t5[1], source)
        after = pools_once_counted(split, before, 1)
        assert after["prefill"]["remote_prefills_total"] - before["prefill"]["remote_prefills_total"] == 1
        assert after["decode"]["remote_prefills_total"] - before["decode"]["remote_prefills_total"] == 1
        assert after["decode"]["encoded_sequences_total"] == before["decode"]["encoded_sequences_total"]
        assert after["decode"]["prefill_fallbacks_total"] == 0
    finally:
        split.stop()
