"""The vendored Open Responses JSON schemas, loaded for tests that check kvrelay's wire objects against them.

The schemas are vendored in tests/fixtures/openresponses (Apache-2.0; its NOTICE names the upstream
commit), so a fresh clone needs nothing beside it. Every file under its `schema/components/schemas` is one
JSON Schema whose `$ref`s name sibling files (`./ItemField.json`), so each is registered in a
`referencing.Registry` under its own file URI and a relative ref resolves to the sibling's URI.
Validation is Draft 2020-12 (the schemas carry no `$schema`; OpenAPI keywords such as `discriminator` are
ignored as unknown keywords).

    validate("ResponseResource", body)      # raises SchemaMismatchError naming the failing path
    validate_stream_event(event)             # picks the `*StreamingEvent` schema by the event's `type`
    STREAM_EVENT_SCHEMAS["response.created"] == "ResponseCreatedStreamingEvent"

The type → schema map is read from the schemas themselves: every `*StreamingEvent` schema whose `type`
property is an enum of one value.
"""

from __future__ import annotations

import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

REPO_ROOT = Path(__file__).resolve().parent.parent
REFERENCE_DIR = REPO_ROOT / "tests" / "fixtures" / "openresponses"
SCHEMA_DIR = REFERENCE_DIR / "schema" / "components" / "schemas"
MANIFEST = REPO_ROOT / "tests" / "fixtures" / "openresponses.sha256"
STREAM_EVENT_SUFFIX = "StreamingEvent"


class SchemaMismatchError(AssertionError):
    """An instance the named schema rejects; the message names the schema, the path and the reason."""


def schema_uri(component: str) -> str:
    return (SCHEMA_DIR / f"{component}.json").as_uri()


@cache
def _schemas() -> dict[str, dict[str, Any]]:
    """Every component schema by name (the file name without `.json`)."""
    if not SCHEMA_DIR.is_dir():
        raise FileNotFoundError(f"the vendored Open Responses schemas are missing at {SCHEMA_DIR}")
    return {
        path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(SCHEMA_DIR.glob("*.json"))
    }


def component_names() -> list[str]:
    return list(_schemas())


def schema(component: str) -> dict[str, Any]:
    """The raw schema of `component` (KeyError for a name the spec does not have)."""
    return _schemas()[component]


@cache
def registry() -> Registry:
    """Every component schema, each under its file URI so that `./X.json` refs resolve to siblings."""
    resources = [
        (schema_uri(name), Resource.from_contents(contents, default_specification=DRAFT202012))
        for name, contents in _schemas().items()
    ]
    return Registry().with_resources(resources).crawl()


@cache
def validator(component: str) -> Draft202012Validator:
    """A validator for `component`, entered through its URI (so refs resolve against that file)."""
    if component not in _schemas():
        raise KeyError(f"no Open Responses schema named {component!r}")
    return Draft202012Validator({"$ref": schema_uri(component)}, registry=registry())


def errors(component: str, instance: Any) -> list[ValidationError]:
    return list(validator(component).iter_errors(instance))


def validate(component: str, instance: Any) -> None:
    """Raises SchemaMismatchError when the `component` schema rejects `instance`."""
    found = errors(component, instance)
    if found:
        raise SchemaMismatchError(_describe(component, instance, found))


def is_valid(component: str, instance: Any) -> bool:
    return validator(component).is_valid(instance)


@cache
def _stream_event_schemas() -> dict[str, str]:
    mapping: dict[str, str] = {}
    for name, contents in _schemas().items():
        if not name.endswith(STREAM_EVENT_SUFFIX):
            continue
        kinds = contents.get("properties", {}).get("type", {}).get("enum", [])
        if len(kinds) != 1:
            raise ValueError(f"{name}: `type` is not an enum of one value: {kinds!r}")
        if kinds[0] in mapping:
            raise ValueError(f"event type {kinds[0]!r} has two schemas: {mapping[kinds[0]]}, {name}")
        mapping[kinds[0]] = name
    return mapping


def stream_event_schemas() -> dict[str, str]:
    """Every streaming event type the spec defines → the name of its schema."""
    return dict(_stream_event_schemas())


def stream_event_schema(kind: str) -> str:
    """The schema name for a streaming event `type` (SchemaMismatchError for a type the spec lacks)."""
    name = _stream_event_schemas().get(kind)
    if name is None:
        raise SchemaMismatchError(f"no Open Responses streaming event has type {kind!r}")
    return name


def validate_stream_event(event: dict[str, Any]) -> str:
    """Validates one streamed event (its data object) by its `type`'s schema; returns the schema name."""
    kind = event.get("type") if isinstance(event, dict) else None
    if not isinstance(kind, str):
        raise SchemaMismatchError(f"a streaming event without a string `type`: {_short(event)}")
    name = stream_event_schema(kind)
    validate(name, event)
    return name


def sha256_manifest(root: Path = REFERENCE_DIR) -> dict[str, str]:
    """sha256 of every file under `root`, by its POSIX path relative to `root`, sorted by path."""
    if not root.is_dir():
        raise FileNotFoundError(f"the vendored Open Responses specification is missing at {root}")
    files = sorted(path for path in root.rglob("*") if path.is_file())
    return {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest() for path in files
    }


def format_manifest(manifest: dict[str, str]) -> str:
    """`manifest` in `sha256sum` format (two spaces, relative paths), one file a line."""
    return "".join(f"{digest}  {path}\n" for path, digest in sorted(manifest.items()))


def read_manifest(path: Path = MANIFEST) -> dict[str, str]:
    """A `sha256sum`-format file as {relative path: sha256}."""
    manifest = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            digest, name = line.split(maxsplit=1)
            manifest[name.strip().removeprefix("*")] = digest
    return manifest


def _describe(component: str, instance: Any, found: list[ValidationError]) -> str:
    best = best_match(found)
    lines = [f"{component} rejects the instance ({len(found)} error(s)); most relevant:"]
    lines.append(f"  at {best.json_path}: {_short(best.message)}")
    for error in _branch_errors(best):
        lines.append(f"    in the branch its `type` selects, at {error.json_path}: {_short(error.message)}")
    for error in found[:5]:
        if error is not best and not best.json_path.startswith(error.json_path):
            lines.append(f"  also at {error.json_path}: {_short(error.message)}")
    lines.append(f"instance: {_short(instance, 600)}")
    return "\n".join(lines)


def _branch_errors(error: ValidationError, depth: int = 0) -> list[ValidationError]:
    """For a oneOf/anyOf miss: the errors of the branch whose `type` matched (the one the instance was
    meant to be), descending through nested unions; [] when no branch's `type` matched."""
    if error.validator not in ("oneOf", "anyOf") or not error.context or depth > 8:
        return []
    branches: dict[Any, list[ValidationError]] = {}
    for sub in error.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    for subs in branches.values():
        if any(_is_type_miss(sub, error) for sub in subs):
            continue
        deeper = [found for sub in subs for found in _branch_errors(sub, depth + 1)]
        return deeper or subs
    return []


def _is_type_miss(sub: ValidationError, parent: ValidationError) -> bool:
    """`sub` says the instance's `type` (its discriminator) or JSON type is not the branch's."""
    relative = list(sub.absolute_path)[len(parent.absolute_path) :]
    return relative == ["type"] or (not relative and sub.validator in ("type", "oneOf", "anyOf"))


def _short(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= limit else text[:limit] + "…"
