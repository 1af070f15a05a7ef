"""The assistant's output beyond plain text, for every protocol: the prompt with tools and thinking, the
constraint that forces or forbids calls and bounds thinking, and the stream of text events split into
reasoning, answer text and tool calls.

`prepare` renders the prompt (the tool-aware template when tools are offered, `enable_thinking` for a
template with a thinking mode) and works out the request's constraint: the tool grammar
(text/tool_calls.py), wrapped after a budgeted thinking block when the model thinks (text/reasoning.py).
`assistant_events` then runs each sample's text through a `ReasoningParser` and a `CallParser`:

    TextDelta (answer text)  ReasoningDelta  ToolCallStarted  ToolCallDelta*  ToolCallDone  ...
    SampleFinished (num_tool_calls set)      Usage

A protocol renders these; with no tools and no thinking the events are the generation's own.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request

from services.codec.admission.gate import SamplingSource
from services.codec.generation import GenerationEvent, GenerationStream, SampleFinished, TextDelta, Usage
from services.codec.protocols.disconnect import run_unless_gone
from services.codec.state import CodecState
from services.codec.text.chat_template import ChatTemplate
from services.codec.text.reasoning import (
    AnswerPiece,
    ReasoningParser,
    ReasoningPiece,
    Thinking,
    prompt_opens_thinking,
    thinking_grammar,
)
from services.codec.text.tool_calls import (
    CallArguments,
    CallEnded,
    CallFormat,
    CallParser,
    CallStarted,
    TextPiece,
    ToolSet,
)
from services.common.grammar import Constraint, GrammarSpec
from services.common.outputs import FinishReason, TokenLogprob


@dataclass(frozen=True)
class ReasoningDelta:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallStarted:
    index: int
    call_index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    index: int
    call_index: int
    fragment: str


@dataclass(frozen=True)
class ToolCallDone:
    index: int
    call_index: int
    arguments: str


AssistantEvent = GenerationEvent | ReasoningDelta | ToolCallStarted | ToolCallDelta | ToolCallDone


@dataclass(frozen=True)
class OutputPlan:
    """How to read one request's output, and the constraint it runs under."""

    tools: ToolSet | None = None
    call_format: CallFormat | None = None
    thinks: bool = False  # the output starts with (or opens) a thinking block worth parsing
    opened: bool = False  # the prompt already opened it
    constraint: Constraint | None = None

    @property
    def is_plain(self) -> bool:
        return not self.thinks and (self.tools is None or not self.tools.is_active)


async def prepare(
    state: CodecState,
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: ToolSet | None,
    thinking: Thinking | None,
    constraint: Constraint | None,
    template: ChatTemplate | None = None,
) -> tuple[list[int], OutputPlan]:
    """The prompt's token IDs and the output plan. `constraint`: the request's own structured output."""
    assistant = state.assistant
    if tools is not None and tools.is_active and not tools.is_forced:
        await _check_tool_schemas(state, tools)  # a forced grammar compiles them; under auto, each alone
    chosen, thinks, variables = _template(state, messages, tools, thinking, template)
    prompt_ids = await state.encoder.chat(
        chosen, messages, tools=tools.template_tools() if tools else None, variables=variables
    )
    opened = thinks and prompt_opens_thinking(
        state.tokenizer.decode(prompt_ids[-4:], skip_special_tokens=False)
    )
    spec = constraint.spec if constraint is not None else None
    param = constraint.param if constraint is not None else "response_format"
    if tools is not None and (tools.tools or spec is not None):
        spec = assistant.call_format.grammar(tools, spec)
        param = tools.param if spec is not None and tools.is_forced else param
    if thinks:
        budget = thinking.budget if thinking is not None else None
        start_id, end_id = assistant.think_ids
        spec = thinking_grammar(spec, budget, opened=opened, start_id=start_id, end_id=end_id)
        param = "thinking" if constraint is None else param
    plan = OutputPlan(
        tools, assistant.call_format, thinks, opened, None if spec is None else Constraint(spec, param)
    )
    return prompt_ids, plan


async def shared_prefix_lengths(
    state: CodecState,
    prompt_ids: list[int],
    messages: Sequence[Mapping[str, Any]],
    variants: Sequence[tuple[Sequence[Mapping[str, Any]], ToolSet | None] | None],
    *,
    tools: ToolSet | None,
    thinking: Thinking | None,
) -> list[int]:
    """For each variant of the conversation `prepare` made `prompt_ids` of, the prompt tokens its prompt
    shares with `prompt_ids` (text/prompts.py shared_prefix_lengths; None: the whole prompt)."""
    chosen, _, variables = _template(state, messages, tools, thinking, None)

    def conversation(
        messages: Sequence[Mapping[str, Any]], tools: ToolSet | None
    ) -> tuple[Sequence[Mapping[str, Any]], list[dict[str, Any]] | None]:
        return messages, tools.template_tools() if tools is not None else None

    return await state.encoder.shared_prefix_lengths(
        chosen,
        prompt_ids,
        conversation(messages, tools),
        [None if variant is None else conversation(*variant) for variant in variants],
        variables,
    )


def _template(
    state: CodecState,
    messages: Sequence[Mapping[str, Any]],
    tools: ToolSet | None,
    thinking: Thinking | None,
    template: ChatTemplate | None,
) -> tuple[ChatTemplate, bool, dict[str, Any] | None]:
    """The template `prepare` renders with, whether the model thinks, and the template's variables."""
    assistant = state.assistant
    chosen = template or assistant.template_for(tools, messages) or state.require_chat_template()
    thinks = assistant.can_think and (thinking is None or thinking.enabled)
    return chosen, thinks, {"enable_thinking": thinks} if assistant.can_think else None


async def _check_tool_schemas(state: CodecState, tools: ToolSet) -> None:
    """Each tool's schema compiled (cached by its text), so that one the grammar engine cannot follow is
    a 400 naming the tool before anything is queued."""
    for index, tool in enumerate(tools.tools):
        spec = GrammarSpec.json_schema(dict(tool.parameters), strict=tool.strict)
        await state.encoder.check_grammar(spec, f"{tools.param}[{index}]")


class Constrained:
    """A request body with its constraint replaced by the output plan's (tools and thinking included)."""

    def __init__(self, body: SamplingSource, constraint: Constraint | None) -> None:
        self._body = body
        self._constraint = constraint

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = {k: v for k, v in self._body.sampling_kwargs().items() if k != "grammar"}
        if self._constraint is not None:
            kwargs["grammar"] = self._constraint.spec
        return kwargs

    def stop_strings(self) -> tuple[str, ...]:
        return self._body.stop_strings()

    def constraint(self) -> Constraint | None:
        return self._constraint


async def assistant_events(
    events: AsyncIterable[GenerationEvent], plan: OutputPlan
) -> AsyncIterator[AssistantEvent]:
    """The generation's events with each sample's text split into reasoning, text and tool calls."""
    if plan.is_plain:
        async for event in events:
            yield event
        return
    samples: dict[int, _SampleSplitter] = {}
    async for event in events:
        if isinstance(event, Usage):
            yield event
            continue
        splitter = samples.setdefault(event.index, _SampleSplitter(event.index, plan))
        if isinstance(event, TextDelta):
            for out in splitter.push(event.text, event.logprobs):
                yield out
        else:
            for out in splitter.finish():
                yield out
            yield replace(event, num_tool_calls=splitter.num_calls)


class _SampleSplitter:
    def __init__(self, index: int, plan: OutputPlan) -> None:
        self.index = index
        self._reasoning = ReasoningParser(opened=plan.opened) if plan.thinks else None
        active = plan.tools is not None and plan.tools.is_active and plan.call_format is not None
        self._calls: CallParser | None = plan.call_format.parser(plan.tools) if active else None  # type: ignore[union-attr,arg-type]

    @property
    def num_calls(self) -> int:
        return self._calls.num_calls if self._calls is not None else 0

    def push(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[AssistantEvent]:
        pieces = self._reasoning.push(text) if self._reasoning is not None else [AnswerPiece(text)]
        out = self._render(pieces)
        if logprobs:
            out.append(TextDelta(self.index, "", logprobs))
        return out

    def finish(self) -> list[AssistantEvent]:
        pieces = self._reasoning.finish() if self._reasoning is not None else []
        out = self._render(pieces)
        if self._calls is not None:
            out += self._call_events(self._calls.finish())
        return out

    def _render(self, pieces: Sequence[ReasoningPiece | AnswerPiece]) -> list[AssistantEvent]:
        out: list[AssistantEvent] = []
        for piece in pieces:
            if isinstance(piece, ReasoningPiece):
                if piece.text:
                    out.append(ReasoningDelta(self.index, piece.text))
            elif self._calls is not None:
                out += self._call_events(self._calls.push(piece.text))
            elif piece.text:
                out.append(TextDelta(self.index, piece.text))
        return out

    def _call_events(self, events: Sequence[Any]) -> list[AssistantEvent]:
        out: list[AssistantEvent] = []
        for event in events:
            if isinstance(event, TextPiece):
                if event.text:
                    out.append(TextDelta(self.index, event.text))
            elif isinstance(event, CallStarted):
                out.append(ToolCallStarted(self.index, event.call_index, event.call_id, event.name))
            elif isinstance(event, CallArguments):
                out.append(ToolCallDelta(self.index, event.call_index, event.fragment))
            elif isinstance(event, CallEnded):
                out.append(ToolCallDone(self.index, event.call_index, event.arguments))
        return out


@dataclass
class Call:
    call_id: str
    name: str
    arguments: str = ""


@dataclass
class CollectedOutput:
    text_parts: list[str] = field(default_factory=list)
    reasoning_parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    finish: SampleFinished | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning(self) -> str:
        return "".join(self.reasoning_parts)


async def collect_output(
    events: AsyncIterable[AssistantEvent], num_samples: int
) -> tuple[list[CollectedOutput], Usage]:
    samples = [CollectedOutput() for _ in range(num_samples)]
    usage = Usage(0, 0, 0)
    async for event in events:
        if isinstance(event, Usage):
            usage = event
            continue
        sample = samples[event.index]
        if isinstance(event, TextDelta):
            sample.text_parts.append(event.text)
            sample.logprobs.extend(event.logprobs)
        elif isinstance(event, ReasoningDelta):
            sample.reasoning_parts.append(event.text)
        elif isinstance(event, ToolCallStarted):
            sample.calls.append(Call(event.call_id, event.name))
        elif isinstance(event, ToolCallDelta):
            sample.calls[event.call_index].arguments += event.fragment
        elif isinstance(event, ToolCallDone):
            sample.calls[event.call_index].arguments = event.arguments
        elif isinstance(event, SampleFinished):
            sample.finish = event
    return samples, usage


def is_tool_finish(finish: SampleFinished | None) -> bool:
    return finish is not None and finish.num_tool_calls > 0 and finish.reason is FinishReason.STOP


async def collect_output_unless_gone(
    request: Request, generation: GenerationStream, plan: OutputPlan, num_samples: int
) -> tuple[list[CollectedOutput], Usage]:
    """The whole split result; if the client leaves first, the generation is aborted (ClientClosedError)."""
    return await run_unless_gone(
        request, generation, lambda: collect_output(assistant_events(generation, plan), num_samples)
    )
