"""The tool-aware templates shipped for models whose own template ignores tools (text/assistant.py):
picked by the model template's turn markers, they put the tools, the assistant's calls and the tools'
results into the prompt; a template that takes tools itself is kept; /tokenize renders a history with
calls the way a chat request does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from services.codec.text.assistant import TEMPLATES, Assistant
from services.codec.text.chat_template import ChatTemplate
from services.codec.text.tokenizer import Tokenizer
from tests.codec_fakes import MODEL_NAME, FakeBackend, identity_for, make_app

pytestmark = pytest.mark.model

GEMMA_LIKE = (
    "{{ bos_token }}{% for m in messages %}"
    "<start_of_turn>{{ 'model' if m.role == 'assistant' else 'user' }}\n{{ m.content }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


def test_a_gemma_template_gets_the_gemma_tool_template(tokenizer: Tokenizer) -> None:
    assistant = Assistant.for_model(tokenizer, ChatTemplate(GEMMA_LIKE, bos_token="<bos>"))
    chosen = assistant.template_for(None, HISTORY)
    assert chosen is not None and chosen.source == (TEMPLATES / "gemma3_tools.jinja").read_text()
    text = chosen.render(HISTORY, tools=TOOLS)
    assert (
        text.startswith(f"{tokenizer.bos_token or ''}<start_of_turn>user\n")
        and '"name": "get_weather"' in text
    )
    assert (
        '<start_of_turn>model\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    )
    assert "<start_of_turn>user\n<tool_response>\n21 C, sunny\n</tool_response><end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n")


def test_chatml_gets_the_chatml_tool_template_and_a_tool_aware_one_is_kept(tokenizer: Tokenizer) -> None:
    own = ChatTemplate(tokenizer.chat_template or "")
    chatml = Assistant.for_model(tokenizer, own)
    assert chatml.call_format.name == "json" and chatml.template_for(None, []) is own
    assert chatml.tools_template is not None and "<tool_response>" in chatml.tools_template.source
    aware = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}{{ tools | tojson }}")
    assert Assistant.for_model(tokenizer, aware).template_for(None, HISTORY) is aware


async def test_tokenize_renders_a_history_with_calls_as_chat_does(
    tokenizer: Tokenizer, model_dir: Path
) -> None:
    fake = FakeBackend(identity_for(model_dir).tokenizer_fingerprint)
    app = make_app(tokenizer, fake, identity_for(model_dir))
    messages = [
        HISTORY[0],
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        HISTORY[2],
    ]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://codec") as client:
        response = await client.post("/tokenize", json={"model": MODEL_NAME, "messages": messages})
    assert response.status_code == 200, response.text
    text = tokenizer.decode(response.json()["tokens"], skip_special_tokens=False)
    assert "<tool_call>" in text and "<tool_response>\n21 C, sunny\n</tool_response>" in text
