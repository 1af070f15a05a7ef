"""A batch's lines: read from an OpenAI input file or an Anthropic request list, checked one by one.

A bad line never fails its batch: it is kept as already done, outcome `errored`, with an error record
(`code`, `message`, `line`) that ends in the error file (OpenAI) or the results (Anthropic). What fails
the whole creation (a 400) is what leaves nothing to run or makes results ambiguous: no lines, more than
`batches.max_lines`, or a custom_id given twice.

Line error codes: `invalid_json_line` (not a JSON object), `invalid_custom_id` (missing or not a
non-empty string), `invalid_method` (not POST), `mismatched_endpoint` (a url other than the batch's
endpoint), `invalid_body` (not an object), `model_not_found` (a model this stack does not serve: every
line of a batch runs on the served model), `unsupported_parameter` (`stream`, or `background` on
/v1/responses: a batch line is answered whole, once).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from services.codec.lane.batch_store import LineRow
from services.common.errors import InvalidRequestError

OPENAI_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ANTHROPIC_ENDPOINT = "/v1/messages"
ANTHROPIC_CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_DEPTH = 64  # a line nested deeper is refused (as a request body is, protocols/request_body.py)


def openai_lines(
    content: bytes, endpoint: str, serves: Callable[[str], bool], max_lines: int
) -> list[LineRow]:
    """The lines of an OpenAI batch input file (JSONL: `custom_id`, `method`, `url`, `body`). A line's
    index is its place in the file (blank lines are skipped, and counted)."""
    lines = []
    for idx, raw in enumerate(content.split(b"\n")):
        if not raw.strip():
            continue
        lines.append(_openai_line(idx, raw, endpoint, serves))
        if len(lines) > max_lines:
            raise InvalidRequestError(
                f"the input file holds more than {max_lines} requests, the most one batch may",
                "input_file_id",
            )
    if not lines:
        raise InvalidRequestError("the input file holds no requests", "input_file_id")
    _check_unique(lines, "input_file_id")
    return lines


def anthropic_lines(requests: list[Any], serves: Callable[[str], bool], max_lines: int) -> list[LineRow]:
    """The lines of an Anthropic batch (`requests`: `custom_id` and `params` each)."""
    if not requests:
        raise InvalidRequestError("requests: at least one request is required", "requests")
    if len(requests) > max_lines:
        raise InvalidRequestError(f"requests: at most {max_lines} requests in one batch", "requests")
    lines = []
    for idx, request in enumerate(requests):
        custom_id = request.get("custom_id") if isinstance(request, dict) else None
        if not isinstance(custom_id, str) or not ANTHROPIC_CUSTOM_ID.fullmatch(custom_id):
            raise InvalidRequestError(
                f"requests.{idx}.custom_id: 1 to 64 letters, digits, '-' or '_' are required", "requests"
            )
        params = request.get("params")
        if not _storable(params):
            lines.append(
                _refused(idx, custom_id, "invalid_body", "params holds a NUL character or lone surrogate")
            )
            continue
        lines.append(_checked(idx, custom_id, ANTHROPIC_ENDPOINT, params, serves))
    _check_unique(lines, "requests")
    return lines


def line_error(idx: int, code: str, message: str) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "line": idx + 1}}


def _openai_line(idx: int, raw: bytes, endpoint: str, serves: Callable[[str], bool]) -> LineRow:
    record = _loads(raw)
    if not isinstance(record, dict):
        return _refused(
            idx, None, "invalid_json_line",
            "the line is not a JSON object (UTF-8, no NaN or Infinity, no NUL character or lone surrogate, "
            f"nested at most {MAX_DEPTH} deep)",
        )  # fmt: skip
    custom_id = record.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _refused(idx, None, "invalid_custom_id", "custom_id must be a non-empty string")
    if record.get("method", "POST") != "POST":
        return _refused(idx, custom_id, "invalid_method", "method must be POST")
    if record.get("url") != endpoint:
        return _refused(
            idx, custom_id, "mismatched_endpoint", f"url must be the batch's endpoint, {endpoint}"
        )
    return _checked(idx, custom_id, endpoint, record.get("body"), serves)


def _loads(raw: bytes) -> Any:
    """The line's JSON value, or None when it is not JSON the store can keep."""
    try:
        text = raw.decode("utf-8")
        if _depth(text) > MAX_DEPTH:
            return None
        value = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None
    return value if _storable(value) else None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _depth(text: str) -> int:
    """How deep brackets nest in `text` (an upper bound: brackets inside strings count too)."""
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _storable(value: Any) -> bool:
    """No NUL character and no lone surrogate anywhere: what PostgreSQL's jsonb and text refuse."""
    try:
        text = json.dumps(value, ensure_ascii=False)
        text.encode("utf-8")
    except (UnicodeEncodeError, ValueError, RecursionError):
        return False
    return "\\u0000" not in text


def _checked(idx: int, custom_id: str, url: str, body: Any, serves: Callable[[str], bool]) -> LineRow:
    if not isinstance(body, dict):
        return _refused(idx, custom_id, "invalid_body", "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not serves(model):
        return _refused(
            idx, custom_id, "model_not_found", f"the model {model!r} is not served here (a batch runs on "
            "the served model)",
        )  # fmt: skip
    if body.get("stream"):
        return _refused(idx, custom_id, "unsupported_parameter", "stream: a batch line is answered whole")
    if url == "/v1/responses" and body.get("background"):
        return _refused(
            idx, custom_id, "unsupported_parameter", "background: a batch line runs queued already"
        )
    return LineRow(idx, custom_id, {"url": url, "body": body})


def _refused(idx: int, custom_id: str | None, code: str, message: str) -> LineRow:
    return LineRow(idx, custom_id, None, "errored", line_error(idx, code, message))


def _check_unique(lines: list[LineRow], param: str) -> None:
    seen: dict[str, int] = {}
    for line in lines:
        if line.custom_id is None:
            continue
        if line.custom_id in seen:
            raise InvalidRequestError(
                f"custom_id {line.custom_id!r} is given twice (requests {seen[line.custom_id] + 1} and "
                f"{line.idx + 1}); each must be unique within the batch",
                param,
            )
        seen[line.custom_id] = line.idx
