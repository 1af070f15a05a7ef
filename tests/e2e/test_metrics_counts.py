"""/metrics counts exactly what was served: N requests raise the request counter and the per-request
latency histograms by N, and the token counters by the sums that usage reported."""

from __future__ import annotations

import httpx
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import RunningStack

N = 5


def scrape(stack: RunningStack) -> dict[str, float]:
    """Sample name -> value, summed over label sets."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{stack.base_url}/metrics").text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def test_n_requests_move_every_counter_by_exactly_what_was_served(stack: RunningStack) -> None:
    client = OpenAI(
        base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, _strict_response_validation=True
    )
    model = client.models.list().data[0].id
    before = scrape(stack)
    prompt_tokens = completion_tokens = 0
    for i in range(N):
        if i % 2:
            reply = client.completions.create(
                model=model, prompt=f"Count to {i + 3}:", max_tokens=6, temperature=0
            )
            usage = reply.usage
        else:
            chat = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"Name {i + 2} colours."}],
                max_tokens=6,
                temperature=0,
            )
            usage = chat.usage
        assert usage is not None
        prompt_tokens += usage.prompt_tokens
        completion_tokens += usage.completion_tokens
    after = scrape(stack)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("kvrelay_requests_total") == N
    assert delta("kvrelay_time_to_first_token_seconds_count") == N
    assert delta("kvrelay_e2e_request_latency_seconds_count") == N
    assert delta("kvrelay_prompt_tokens_total") == prompt_tokens
    assert delta("kvrelay_generation_tokens_total") == completion_tokens
    # The inter-token histogram counts gaps between deltas, at most one fewer than the tokens per request.
    assert 0 < delta("kvrelay_inter_token_latency_seconds_count") <= completion_tokens - N
