"""Chat templates: messages → prompt text, rendered the way transformers' `apply_chat_template` does.

Templates come from model repositories and are untrusted code, so they run in Jinja's immutable
sandbox with the same globals and filters transformers provides (`raise_exception`,
`strftime_now`, a `tojson` that does not HTML-escape, a guarded `namespace` and `dict`, and the
`{% generation %}` tag). Everything a template sees is first copied into plain JSON types.

A template that rejects the conversation (`raise_exception`) or fails on it raises
ChatTemplateError, an InvalidRequestError, so the caller gets a 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.codec.text.tokenizer import Tokenizer
from services.common.errors import CorruptModelError, InvalidRequestError

# Errors a template can raise on the data it is given, rather than on its own syntax.
_RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError)


class ChatTemplateError(InvalidRequestError):
    """The chat template rejected the conversation or failed while rendering it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, param="messages")


class ChatTemplateMissingError(InvalidRequestError):
    """The model has no chat template, so chat requests cannot be served."""

    def __init__(self) -> None:
        super().__init__(
            "this model has no chat template; use /v1/completions or configure a template",
            param="messages",
        )


class ChatTemplate:
    """One compiled template. `render` is safe to call from many requests; it keeps no state."""

    def __init__(self, source: str, *, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        self._special_tokens = {"bos_token": bos_token or "", "eos_token": eos_token or ""}
        try:
            self._template = _make_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise CorruptModelError(f"chat template does not parse: {exc}") from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """The prompt text for `messages`. `extra` reaches the template as variables
        (e.g. `enable_thinking`); it may override `bos_token` and `eos_token`."""
        context: dict[str, Any] = {
            **self._special_tokens,
            **_plain_data(extra),
            "messages": [_plain_message(message) for message in messages],
            "tools": _plain_data(list(tools)) if tools is not None else None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text: str = self._template.render(**context)
        except _RENDER_ERRORS as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
        return text


def chat_template_from_tokenizer(tokenizer: Tokenizer, override: str | None = None) -> ChatTemplate:
    """The model's chat template, or `override` when given. Raises ChatTemplateMissingError
    when neither exists."""
    source = override if override is not None else tokenizer.chat_template
    if source is None:
        raise ChatTemplateMissingError()
    return ChatTemplate(source, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token)


def render_and_encode(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **extra: Any,
) -> list[int]:
    """Renders `messages` and encodes the text without adding special tokens: the template
    already wrote them."""
    text = template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
    return tokenizer.encode(text, add_special_tokens=False)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """transformers' `tojson`: plain `json.dumps`, without Jinja's HTML escaping."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    """`dict(...)` for templates, without exposing the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names (a route to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # takes self in args, as jinja2.utils.Namespace does
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_namespace_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a template namespace cannot hold {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; it renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2 reads this class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _plain_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as plain data, without None-valued keys (APIs send `content=None`; templates
    handle a missing key but may print "None")."""
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"a chat message must be an object, got {type(message).__name__}")
    return {str(key): _plain_data(value) for key, value in message.items() if value is not None}


def _plain_data(value: Any) -> Any:
    """A copy of `value` built from JSON types only, so the sandbox never sees a rich object."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(item) for item in value)
    return f"<{type(value).__name__}>"
