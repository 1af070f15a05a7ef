"""`kvrelay up --model <Gemma 3 dir> --port 0`: the whole stack serves completions from Gemma 3 270M, a
model without a chat template, and answers chat routes with a clear 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.test_up import UpStack, complete, start_up

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def gemma_stack(gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpStack]:
    running = start_up(gemma_dir, tmp_path_factory.mktemp("up-gemma"), free_ports=True)
    yield running
    running.stop()


def test_completions_go_through_the_stack(gemma_stack: UpStack) -> None:
    reply = complete(gemma_stack.url, "The capital of France is")
    assert reply["usage"]["completion_tokens"] == 5
    assert "capital" in reply["choices"][0]["text"] or "Paris" in reply["choices"][0]["text"]


def test_streamed_completion_of_a_prompt_longer_than_the_window(gemma_stack: UpStack) -> None:
    model = httpx.get(f"{gemma_stack.url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    prompt = "The river rose slowly through the night. " * 80 + "In summary,"  # ~800 tokens
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{gemma_stack.url}/v1/completions", json=body, timeout=120.0) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and len(lines) >= 3


def test_chat_routes_answer_400_without_a_chat_template(gemma_stack: UpStack) -> None:
    model = httpx.get(f"{gemma_stack.url}/v1/models", timeout=10.0).json()["data"][0]["id"]
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(
        f"{gemma_stack.url}/v1/chat/completions",
        json={"model": model, "messages": messages, "max_tokens": 4},
        timeout=60.0,
    )
    assert chat.status_code == 400, chat.text
    assert "no chat template" in chat.json()["error"]["message"]
    anthropic = httpx.post(
        f"{gemma_stack.url}/v1/messages",
        json={"model": model, "messages": messages, "max_tokens": 4},
        timeout=60.0,
    )
    assert anthropic.status_code == 400, anthropic.text
    assert "no chat template" in anthropic.text
