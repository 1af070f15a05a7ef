"""Structured output on the wire: each protocol's way of asking for it, turned into one GrammarSpec
(services/common/grammar.py), which the gate compiles before anything is queued (a 400 if it cannot).

    OpenAI Chat       response_format {type: text | json_object | json_schema {name, schema, strict}}
    OpenAI Responses  text.format {type: text | json_object | json_schema, name, schema, strict}
    Anthropic         output_config.format {type: json_schema, schema} (the SDK's `messages.parse`)
    vLLM extras       structured_outputs {json | regex | choice | grammar | json_object} on Chat and
                      Completions, and the older guided_json, guided_regex, guided_choice, guided_grammar

A request names at most one constraint. OpenAI's `strict: true` compiles the schema strictly: a keyword
the grammar engine does not implement is a 400 instead of being ignored. Anthropic's schemas are always
strict (its SDK sends schemas it has made strict-compatible).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from services.common.errors import InvalidRequestError
from services.common.grammar import Constraint, GrammarKind, GrammarSpec

SchemaName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class JsonSchemaFormat(_Open):
    """Chat's `response_format.json_schema`."""

    name: SchemaName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Open):
    """Chat's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class TextFormat(_Open):
    """Responses' `text.format`: the json_schema fields sit beside `type`."""

    type: Literal["text", "json_object", "json_schema"]
    name: SchemaName | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class AnthropicFormat(_Open):
    """Anthropic's `output_config.format`."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class StructuredOutputs(_Open):
    """vLLM's `structured_outputs` (and, field by field, its older `guided_*` extras)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def from_response_format(value: ResponseFormat | None) -> GrammarSpec | None:
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    if value.json_schema is None or value.json_schema.schema_ is None:
        raise InvalidRequestError("response_format json_schema needs json_schema.schema", "response_format")
    return GrammarSpec.json_schema(value.json_schema.schema_, strict=bool(value.json_schema.strict))


def from_text_format(value: TextFormat | None) -> GrammarSpec | None:
    if value is None or value.type == "text":
        return None
    if value.type == "json_object":
        return GrammarSpec(GrammarKind.JSON_OBJECT)
    if value.schema_ is None or value.name is None:
        raise InvalidRequestError("text.format json_schema needs name and schema", "text.format")
    return GrammarSpec.json_schema(value.schema_, strict=bool(value.strict))


def from_anthropic_format(value: AnthropicFormat | None) -> GrammarSpec | None:
    return None if value is None else GrammarSpec.json_schema(value.schema_, strict=True)


def from_vllm(
    structured: StructuredOutputs | None,
    guided_json: dict[str, Any] | str | None,
    guided_regex: str | None,
    guided_choice: list[str] | None,
    guided_grammar: str | None,
) -> Constraint | None:
    """The vLLM-style constraint and the field that named it; a 400 when several are named."""
    found: list[tuple[GrammarSpec, str]] = []
    if structured is not None:
        found += _named(
            structured.json_, structured.regex, structured.choice, structured.grammar, "structured_outputs"
        )
        if structured.json_object:
            found.append((GrammarSpec(GrammarKind.JSON_OBJECT), "structured_outputs.json_object"))
    found += _named(guided_json, guided_regex, guided_choice, guided_grammar, None)
    return pick(*found)


def _named(
    json_value: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    grammar: str | None,
    prefix: str | None,
) -> list[tuple[GrammarSpec, str]]:
    def param(field: str) -> str:
        return f"{prefix}.{field}" if prefix else f"guided_{field}"

    found: list[tuple[GrammarSpec, str]] = []
    if json_value is not None:
        found.append((_json_spec(json_value, param("json")), param("json")))
    if regex is not None:
        found.append((GrammarSpec(GrammarKind.REGEX, regex), param("regex")))
    if choice is not None:
        found.append((GrammarSpec.choice(choice), param("choice")))
    if grammar is not None:
        found.append((GrammarSpec(GrammarKind.LARK, grammar), param("grammar")))
    return found


def _json_spec(value: dict[str, Any] | str, param: str) -> GrammarSpec:
    if isinstance(value, dict):
        return GrammarSpec.json_schema(value)
    return GrammarSpec(
        GrammarKind.JSON_SCHEMA, value
    )  # a schema already as JSON text (checked when compiled)


def pick(*candidates: tuple[GrammarSpec | None, str] | Constraint | None) -> Constraint | None:
    """The one constraint among a request's fields; a 400 naming the second when there are several."""
    found: list[Constraint] = []
    for candidate in candidates:
        if isinstance(candidate, Constraint):
            found.append(candidate)
        elif candidate is not None and candidate[0] is not None:
            found.append(Constraint(candidate[0], candidate[1]))
    if len(found) > 1:
        names = ", ".join(c.param for c in found)
        raise InvalidRequestError(
            f"name one structured output constraint, not several ({names})", found[1].param
        )
    return found[0] if found else None
