"""The soak's traffic (services/bench/soak/traffic.py): every kind builds a request of its protocol (tools
and structured output where it says so), cancels are 15% of the mix, and a stream's events are judged in
each protocol's own shape: an error event is a server error, and only the terminal event makes it ok."""

from __future__ import annotations

import random

from services.bench.serve.clients import PATHS
from services.bench.soak.traffic import KINDS, _event, make_request


def test_every_kind_builds_its_request() -> None:
    rng = random.Random(0)
    built = {kind: make_request(kind, rng, "m", 8) for kind in KINDS}
    assert built["chat-tools"].body["tool_choice"] == "required" and built["chat-tools"].body["tools"]
    assert built["anthropic-tools"].body["tool_choice"] == {"type": "any"}
    assert built["chat-structured"].body["response_format"]["type"] == "json_schema"
    assert built["responses-structured"].body["text"]["format"]["type"] == "json_schema"
    assert built["cancel"].cancel and built["cancel"].stream
    assert not any(r.stream for k, r in built.items() if k in ("chat", "chat-tools", "anthropic-tools"))
    assert {r.protocol for r in built.values()} == set(PATHS)
    assert KINDS["cancel"] / sum(KINDS.values()) >= 0.10


def test_stream_events_are_judged_in_each_protocols_shape() -> None:
    assert _event(" [DONE]") == (False, True)
    assert _event('{"type": "response.completed", "response": {}}') == (False, True)
    assert _event('{"type": "message_stop"}') == (False, True)
    assert _event('{"choices": [{"delta": {"content": "hi"}}]}') == (False, False)
    assert _event('{"error": {"message": "boom"}}') == (True, False)
    assert _event('{"type": "error", "error": {"type": "overloaded_error"}}') == (True, False)
    assert _event('{"type": "response.failed", "response": {}}') == (True, False)
    assert _event("not json") == (True, False)
