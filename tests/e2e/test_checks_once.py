"""Each fact about a request is checked once per process it crosses (services/common/engine_input.py).

The stack's three processes (worker, router, codec) run with tests/check_counter on PYTHONPATH, which
counts each call of the three checks per process. One streamed chat request, sent with the OpenAI SDK,
must be checked: its sampling settings once in the codec and once in the worker, its prompt's token
range once in the worker (the codec made the IDs itself, with its tokenizer), and its request ID once in
the router and once in the worker, against each process's live IDs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.e2e.conftest import RunningStack, start_stack
from tests.stack_helpers import REPO_ROOT

pytestmark = pytest.mark.model

COUNTER = REPO_ROOT / "tests" / "check_counter"


@pytest.fixture(scope="module")
def counts_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("check-counts")


@pytest.fixture(scope="module")
def counted_stack(
    model_dir: Path, counts_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    running = start_stack(
        model_dir,
        tmp_path_factory.mktemp("counted-stack-logs"),
        PYTHONPATH=f"{COUNTER}:{REPO_ROOT}",
        KVRELAY_CHECK_COUNTS=str(counts_dir),
    )
    yield running
    for proc in reversed(running.procs):
        proc.stop()


def checks_by_process(stack: RunningStack, counts_dir: Path) -> dict[str, Counter[str]]:
    roles = {
        proc.popen.pid: role for proc, role in zip(stack.procs, ("worker", "router", "codec"), strict=True)
    }
    counts: dict[str, Counter[str]] = {role: Counter() for role in roles.values()}
    for log in counts_dir.glob("*.log"):
        counts[roles[int(log.stem)]].update(log.read_text().split())
    return counts


def test_one_streamed_chat_request_is_checked_once_per_process(
    counted_stack: RunningStack, counts_dir: Path
) -> None:
    client = OpenAI(
        base_url=f"{counted_stack.base_url}/v1",
        api_key="unused",
        max_retries=0,
        _strict_response_validation=True,
    )
    model = client.models.list().data[0].id
    before = checks_by_process(counted_stack, counts_dir)
    assert before["worker"]["sampling"] >= 1, (
        "the counter is not on: the worker's warm-up request was not seen"
    )
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=8,
        temperature=0.7,
        top_p=0.9,
        seed=3,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text
    after = checks_by_process(counted_stack, counts_dir)
    request = {role: after[role] - before[role] for role in after}
    assert request["codec"] == Counter({"sampling": 1}), request
    assert request["router"] == Counter({"request_id": 1}), request
    assert request["worker"] == Counter({"sampling": 1, "token_range": 1, "request_id": 1}), request
