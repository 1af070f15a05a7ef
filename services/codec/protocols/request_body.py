"""Reading a JSON request body and parsing it into a schema, with OpenAI-style 4xx errors.

The body is read by the route (not by FastAPI's dependency machinery) so that each failure gets its
own error: wrong Content-Type (415), over the size limit (413, raised by the middleware while the body
streams in), invalid UTF-8, invalid JSON or a non-object body (400), and schema violations (400 naming
the param, e.g. `messages[0].role`).

Hostile bodies are refused before they cost anything: arrays and objects nested deeper than
MAX_JSON_DEPTH (400, checked on the raw text before parsing, so a 100,000-deep body never reaches the
parser's recursion), and strings holding a lone UTF-16 surrogate (`"\ud800"`: valid JSON, but no
text, so the tokenizer could not encode it) are a 400 naming where it is.
"""

from __future__ import annotations

import functools
import json
import re
import typing
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from services.codec.errors import MalformedBodyError, UnknownParameterError, UnsupportedMediaTypeError
from services.common import tracing
from services.common.errors import InvalidRequestError

SchemaT = TypeVar("SchemaT", bound=BaseModel)
JSON_TYPES = ("application/json",)
MAX_JSON_DEPTH = 64  # a JSON schema of a tool or a response format nests far less than this
_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')  # a string (skipped whole) or a bracket
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # \ud800-\udfff: one half of a surrogate pair


async def read_json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object. Raises the 4xx errors described in the module docstring."""
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in JSON_TYPES and not media_type.endswith("+json"):
        shown = media_type or "none"
        raise UnsupportedMediaTypeError(f"Content-Type must be application/json, got {shown}")
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedBodyError(f"the body is not valid UTF-8 (byte {exc.start})") from None
    _check_depth(text)
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as exc:
        raise MalformedBodyError(f"the body is not valid JSON: {exc}") from None
    if _SURROGATE_ESCAPE.search(text):  # only then can a parsed string hold a lone surrogate
        _check_text(data, "")
    if not isinstance(data, dict):
        raise MalformedBodyError(f"the body must be a JSON object, got {_json_type(data)}")
    return data


def _check_depth(text: str) -> None:
    """A 400 when arrays and objects nest deeper than MAX_JSON_DEPTH (strings are skipped whole)."""
    depth = 0
    for match in _STRUCTURE.finditer(text):
        char = match.group()
        if char in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise MalformedBodyError(f"the body nests arrays and objects deeper than {MAX_JSON_DEPTH}")
        elif char in "]}":
            depth -= 1


def _check_text(value: Any, where: str) -> None:
    """A 400 naming the first string (key or value) that holds a lone surrogate."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(
                f"{where or 'the body'}: a string holds a lone UTF-16 surrogate, which is not text",
                param=where or None,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_text(item, f"{where}[{index}]")


async def read_request(request: Request, schema: type[SchemaT]) -> SchemaT:
    """The body read and parsed into `schema`: `read_json_object` then `parse_schema`, traced as the
    request's "parse" span."""
    with tracing.span("parse"):
        return parse_schema(schema, await read_json_object(request))


def parse_schema(schema: type[SchemaT], data: dict[str, Any]) -> SchemaT:
    """Validates `data`; the first problem becomes a 400 naming its param."""
    try:
        return schema.model_validate(data)
    except ValidationError as exc:
        raise _to_request_error(exc, _field_names(schema)) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a valid JSON number")


def _json_type(value: object) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _to_request_error(exc: ValidationError, field_names: set[str]) -> InvalidRequestError:
    errors = exc.errors(include_url=False)
    extra = [error for error in errors if error["type"] == "extra_forbidden"]
    if extra:
        param = _param(extra[0]["loc"], field_names | {str(extra[0]["loc"][-1])})
        return UnknownParameterError(f"unrecognized request argument supplied: {param}", param=param)
    deepest = max(errors, key=lambda item: len(item["loc"]))  # the most specific problem
    param = _param(deepest["loc"], field_names)
    # A union (e.g. str | list) fails once per member at the same param: say all of them.
    messages = dict.fromkeys(e["msg"] for e in errors if _param(e["loc"], field_names) == param)
    message = " or ".join(messages)
    return InvalidRequestError(f"{param}: {message}" if param else message, param=param or None)


def _param(loc: tuple[int | str, ...], field_names: set[str]) -> str:
    """`('messages', 0, 'content', 'str')` → `messages[0].content`: union labels are dropped."""
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in field_names:
            text += f".{part}" if text else part
    return text


@functools.cache
def _field_names(schema: type[BaseModel]) -> set[str]:
    """Every field name of `schema` and the models nested in it."""
    names: set[str] = set()
    pending: list[type[BaseModel]] = [schema]
    seen: set[type[BaseModel]] = set()
    while pending:
        model = pending.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            names.add(name)
            pending.extend(_nested_models(info.annotation))
    return names


def _nested_models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in typing.get_args(annotation) for model in _nested_models(arg)]
