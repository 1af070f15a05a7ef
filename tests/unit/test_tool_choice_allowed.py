"""OpenAI's `allowed_tools` tool choice is a hard constraint: every tool stays in the prompt, but a call
may only name an allowed one (forced: the grammar offers only them; auto: any other call comes back as
text); naming a tool that is not offered is a 400."""

from __future__ import annotations

import pytest

from services.codec.text.tool_calls import (
    JSON_FORM,
    CallStarted,
    TextPiece,
    Tool,
    ToolChoice,
    ToolChoiceMode,
    ToolSet,
)
from services.common.errors import InvalidRequestError

OBJECT = {"type": "object", "properties": {"x": {"type": "integer"}}}
TOOLS = (Tool("alpha", OBJECT), Tool("beta", OBJECT))


def calls_in(tools: ToolSet, text: str) -> tuple[list[str], str]:
    parser = JSON_FORM.parser(tools)
    events = parser.push(text) + parser.finish()
    names = [e.name for e in events if isinstance(e, CallStarted)]
    return names, "".join(e.text for e in events if isinstance(e, TextPiece))


def test_auto_keeps_calls_to_allowed_tools_and_returns_others_as_text() -> None:
    tools = ToolSet(TOOLS, ToolChoice(ToolChoiceMode.AUTO, allowed=("alpha",)))
    allowed = '<tool_call>\n{"name": "alpha", "arguments": {"x": 1}}\n</tool_call>'
    other = '<tool_call>\n{"name": "beta", "arguments": {"x": 1}}\n</tool_call>'
    assert calls_in(tools, allowed) == (["alpha"], "")
    assert calls_in(tools, other) == ([], other)
    assert [t["function"]["name"] for t in tools.template_tools() or []] == ["alpha", "beta"]


def test_required_forces_a_call_among_the_allowed_only() -> None:
    tools = ToolSet(TOOLS, ToolChoice(ToolChoiceMode.REQUIRED, allowed=("beta",)))
    grammar = JSON_FORM.grammar(tools)
    assert (
        grammar is not None and '"const": "beta"' in grammar.text and '"const": "alpha"' not in grammar.text
    )


def test_allowing_a_tool_that_is_not_offered_is_a_400() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        ToolSet(TOOLS, ToolChoice(ToolChoiceMode.AUTO, allowed=("gamma",)))
    assert caught.value.param == "tool_choice"
