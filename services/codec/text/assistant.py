"""What a model can do beyond plain text, decided once at start from its tokenizer and chat template:
the tool call format (text/tool_calls.py), the template that shows it tools, and whether it can think
(text/reasoning.py).

A model whose template ignores tools (SmolLM2's, Gemma 3's: the source never mentions `tools`) gets a
tool-aware template shipped in text/templates/, chosen by the template's turn markers (ChatML's
`<|im_start|>`, Gemma's `<start_of_turn>`), used only for requests that offer tools; without one the
tools would never reach the prompt. `model.tool_call_format` overrides the detected call format.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.codec.text.chat_template import ChatTemplate
from services.codec.text.reasoning import END as THINK_END
from services.codec.text.reasoning import START as THINK_START
from services.codec.text.reasoning import template_has_thinking
from services.codec.text.tokenizer import Tokenizer
from services.codec.text.tool_calls import CallFormat, ToolSet, detect_format, single_token_ids

TEMPLATES = Path(__file__).parent / "templates"
SHIPPED_BY_MARKER = {"<|im_start|>": "chatml_tools.jinja", "<start_of_turn>": "gemma3_tools.jinja"}
MARKERS = ("<tool_call>", "</tool_call>", "<|python_tag|>", THINK_START, THINK_END)


@dataclass(frozen=True)
class Assistant:
    call_format: CallFormat
    template: ChatTemplate | None  # the model's (or the configured) template
    tools_template: (
        ChatTemplate | None
    )  # for requests with tools: the model's if it takes tools, else shipped
    can_think: bool
    think_ids: tuple[int | None, int | None] = (None, None)  # `<think>`, `</think>` where each is one token

    @classmethod
    def for_model(
        cls, tokenizer: Tokenizer, template: ChatTemplate | None, configured_format: str = "auto"
    ) -> Assistant:
        ids = {m: i for m in MARKERS if (i := tokenizer.token_to_id(m)) is not None}
        return cls(
            call_format=detect_format(single_token_ids(ids, MARKERS), configured_format),
            template=template,
            tools_template=_tools_template(tokenizer, template),
            can_think=template is not None and template_has_thinking(template.source),
            think_ids=(ids.get(THINK_START), ids.get(THINK_END)),
        )

    def template_for(
        self, tools: ToolSet | None, messages: Sequence[Mapping[str, Any]] = ()
    ) -> ChatTemplate | None:
        """The tool-aware template when the request offers tools or its history holds calls or results
        (the model's own would drop them), else the model's."""
        if tools is not None and tools.template_tools():
            return self.tools_template
        if any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            return self.tools_template
        return self.template


def _tools_template(tokenizer: Tokenizer, template: ChatTemplate | None) -> ChatTemplate | None:
    if template is None or "tools" in template.source:
        return template
    for marker, name in SHIPPED_BY_MARKER.items():
        if marker in template.source:
            source = (TEMPLATES / name).read_text(encoding="utf-8")
            return ChatTemplate(source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)
    return template  # no shipped form for this template: tools do not reach its prompt
