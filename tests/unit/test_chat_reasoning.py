"""Reasoning through OpenAI Chat on a template with a thinking mode (tests/fixtures/qwen3_think.jinja over
SmolLM2's tokenizer, a fake backend at the seam): the thinking comes back as `reasoning_content`, apart from
the answer; `enable_thinking: false` closes the block in the prompt; a budget becomes a grammar that ends
the block; a forced call starts after the thinking."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import llguidance
import pytest

from services.codec.text.tokenizer import Tokenizer
from services.common.config import KvrelayConfig, LimitsConfig, ModelConfig
from services.common.grammar import GrammarCompiler, GrammarKind
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app, scripted

pytestmark = pytest.mark.model

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "qwen3_think.jinja"
USER = [{"role": "user", "content": "What is 2 + 2?"}]
TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


@pytest.fixture
def rig(model_dir: Path) -> tuple[httpx.AsyncClient, FakeBackend, Tokenizer]:
    tokenizer = Tokenizer.from_dir(model_dir)
    fake = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    config = KvrelayConfig(limits=LimitsConfig(), model=ModelConfig(chat_template=str(TEMPLATE)))
    app = make_app(tokenizer, fake, identity_for(model_dir), config)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec")
    return client, fake, tokenizer


async def chat(client: httpx.AsyncClient, **fields: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": USER, "max_tokens": 64, **fields}
    return await client.post("/v1/chat/completions", json=body)


def prompt_text(fake: FakeBackend, tokenizer: Tokenizer) -> str:
    return tokenizer.decode(fake.seen[-1].prompt_token_ids, skip_special_tokens=False)


async def test_thinking_comes_back_apart_from_the_answer(rig: Any) -> None:
    client, fake, tokenizer = rig
    fake.script = scripted([tokenizer.encode("Two and two.\n</think>\n\nIt is 4.")])
    response = await chat(client)
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    assert message["reasoning_content"] == "Two and two.\n" and message["content"] == "It is 4."
    assert prompt_text(fake, tokenizer).endswith("<|im_start|>assistant\n<think>\n")

    streamed = await chat(client, stream=True)
    deltas = [
        json.loads(line[6:])["choices"][0]["delta"]
        for line in streamed.text.splitlines()
        if line.startswith("data: {") and '"choices":[{' in line
    ]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Two and two.\n"
    assert "".join(d.get("content", "") for d in deltas) == "It is 4."


async def test_thinking_off_closes_the_block_in_the_prompt_and_everything_is_answer(rig: Any) -> None:
    client, fake, tokenizer = rig
    fake.script = scripted([tokenizer.encode("It is 4.")])
    response = await chat(client, chat_template_kwargs={"enable_thinking": False})
    message = response.json()["choices"][0]["message"]
    assert message["content"] == "It is 4." and "reasoning_content" not in message
    assert prompt_text(fake, tokenizer).endswith("<think>\n\n</think>\n\n")
    assert fake.seen[-1].sampling.grammar is None


async def test_a_budget_is_a_grammar_that_forces_the_end_of_thinking(rig: Any, model_dir: Path) -> None:
    client, fake, tokenizer = rig
    fake.script = scripted([tokenizer.encode("4")])
    assert (await chat(client, reasoning_effort="low")).status_code == 200
    spec = fake.seen[-1].sampling.grammar
    assert spec is not None and spec.kind is GrammarKind.LARK and "max_tokens=1024" in spec.text
    small = spec.text.replace("max_tokens=1024", "max_tokens=4")
    compiler = GrammarCompiler((model_dir / "tokenizer.json").read_text(), [2])
    matcher = compiler.matcher(type(spec)(GrammarKind.LARK, small))
    for token in tokenizer.encode(" one two three four")[:4]:
        assert matcher.consume_token(token)
    end = tokenizer.encode("</think>")
    mask = matcher.compute_logit_bias()  # after the budget only the closing marker's text may follow
    allowed = [i for i, b in enumerate(mask) if b]
    assert end[0] in allowed and tokenizer.encode(" five")[0] not in allowed
    assert isinstance(matcher, llguidance.LLMatcher)


async def test_a_forced_call_starts_after_the_thinking(rig: Any) -> None:
    client, fake, tokenizer = rig
    text = 'Use add.\n</think>\n\n<tool_call>\n{"name":"add","arguments":{"a":2,"b":2}}\n</tool_call>'
    fake.script = scripted([tokenizer.encode(text)])
    response = await chat(client, tools=[TOOL], tool_choice="required")
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "Use add.\n"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "add" and json.loads(call["arguments"]) == {"a": 2, "b": 2}
    grammar = fake.seen[-1].sampling.grammar.text
    assert grammar.index('"</think>"') < grammar.index("<tool_call>")
    assert "# Tools" in prompt_text(fake, tokenizer)  # this template takes tools itself
