"""Chat templates: golden SmolLM2 renders and token IDs, HF parity, errors and the sandbox."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest

from services.codec.text.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateMissingError,
    chat_template_from_tokenizer,
    render_and_encode,
)
from services.codec.text.tokenizer import Tokenizer
from services.common.errors import CorruptModelError, InvalidRequestError
from tests.unit.test_tokenizer import write_tiny_model

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

SINGLE_TURN = [{"role": "user", "content": "What is the capital of France?"}]
SINGLE_TURN_TEXT = (
    f"<|im_start|>system\n{DEFAULT_SYSTEM}<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\n"
)
# Checked piece by piece against the vocabulary ("Ġ" is a leading space, "Ċ" a newline).
SINGLE_TURN_IDS = [
    1, 9690, 198,  # <|im_start|> system \n
    2683, 359, 253, 5356, 5646, 11173, 3365,  # You ␣are ␣a ␣helpful ␣AI ␣assistant ␣named
    3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,  # ␣Sm ol LM , ␣trained ␣by ␣H ugging ␣Face
    2, 198,  # <|im_end|> \n
    1, 4093, 198,  # <|im_start|> user \n
    1780, 314, 260, 3575, 282, 4649, 47,  # What ␣is ␣the ␣capital ␣of ␣France ?
    2, 198,  # <|im_end|> \n
    1, 520, 9531, 198,  # <|im_start|> ass istant \n
]  # fmt: skip

CUSTOM_SYSTEM = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "Name a colour."},
]
CUSTOM_SYSTEM_TEXT = (
    "<|im_start|>system\nYou answer in one word.<|im_end|>\n"
    "<|im_start|>user\nName a colour.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

MULTI_TURN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello. Café? 日本語 ok 👍"},
    {"role": "user", "content": "Bye."},
]
MULTI_TURN_TEXT = (
    "<|im_start|>system\nYou are terse.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n"
    "<|im_start|>assistant\nHello. Café? 日本語 ok 👍<|im_end|>\n"
    "<|im_start|>user\nBye.<|im_end|>\n"
    "<|im_start|>assistant\n"
)

GOLDEN_CASES = [
    pytest.param(SINGLE_TURN, SINGLE_TURN_TEXT, id="default-system"),
    pytest.param(CUSTOM_SYSTEM, CUSTOM_SYSTEM_TEXT, id="custom-system"),
    pytest.param(MULTI_TURN, MULTI_TURN_TEXT, id="multi-turn"),
]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def template(tokenizer: Tokenizer) -> ChatTemplate:
    return chat_template_from_tokenizer(tokenizer)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path) -> Any:
    import transformers  # heavy: imported only by the tests that compare against it

    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def hf_chat_ids(hf_tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    return list(ids)


@pytest.mark.model
@pytest.mark.parametrize(("messages", "expected_text"), GOLDEN_CASES)
def test_smollm2_template_renders_chatml(
    template: ChatTemplate, messages: list[dict[str, str]], expected_text: str
) -> None:
    assert template.render(messages) == expected_text


@pytest.mark.model
@pytest.mark.parametrize(("messages", "expected_text"), GOLDEN_CASES)
def test_smollm2_token_ids_match_transformers(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    hf_tokenizer: Any,
    messages: list[dict[str, str]],
    expected_text: str,
) -> None:
    ids = render_and_encode(template, tokenizer, messages)
    assert ids == hf_chat_ids(hf_tokenizer, messages)
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected_text


@pytest.mark.model
def test_smollm2_single_turn_token_ids_are_golden(template: ChatTemplate, tokenizer: Tokenizer) -> None:
    assert render_and_encode(template, tokenizer, SINGLE_TURN) == SINGLE_TURN_IDS


@pytest.mark.model
def test_without_generation_prompt_ends_after_last_turn(template: ChatTemplate) -> None:
    text = template.render(SINGLE_TURN, add_generation_prompt=False)
    assert text == SINGLE_TURN_TEXT.removesuffix("<|im_start|>assistant\n")


def test_raise_exception_becomes_chat_template_error() -> None:
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
    )
    with pytest.raises(ChatTemplateError, match="first message must be user") as exc_info:
        template.render([{"role": "assistant", "content": "hi"}])
    assert isinstance(exc_info.value, InvalidRequestError)


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ messages.__class__.__init__.__globals__['os'] }}",
        "{{ raise_exception.__globals__['__builtins__']['open']('/etc/passwd').read() }}",
        "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
        "{{ messages.append({'role': 'x'}) }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    ],
)
def test_sandbox_blocks_attribute_escapes(source: str) -> None:
    with pytest.raises(ChatTemplateError) as exc_info:
        ChatTemplate(source).render(SINGLE_TURN)
    assert isinstance(exc_info.value.__cause__, jinja2.exceptions.SecurityError)


def test_sandbox_leaks_nothing_through_unsafe_attribute() -> None:
    assert ChatTemplate("[{{ ''.__class__ }}]").render(SINGLE_TURN) == "[]"


def test_tojson_keeps_non_ascii_and_supports_indent() -> None:
    template = ChatTemplate("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}")
    tools = [{"name": "météo", "html": "<b>"}]
    expected = '[{"name": "météo", "html": "<b>"}]|{\n  "name": "météo",\n  "html": "<b>"\n}'
    assert template.render(SINGLE_TURN, tools=tools) == expected


def test_passes_special_tokens_and_extra_variables() -> None:
    template = ChatTemplate("{{ bos_token }}{{ flag }}{{ eos_token }}", bos_token="<s>", eos_token="</s>")
    assert template.render([], flag="X") == "<s>X</s>"


def test_none_valued_message_keys_are_dropped() -> None:
    template = ChatTemplate("{% for m in messages %}{{ m.content is defined }}{% endfor %}")
    assert template.render([{"role": "assistant", "content": None}]) == "False"


def test_generation_tag_renders_its_body() -> None:
    template = ChatTemplate("a{% generation %}b{% endgeneration %}c")
    assert template.render([]) == "abc"


def test_template_with_syntax_error_is_a_corrupt_model() -> None:
    with pytest.raises(CorruptModelError):
        ChatTemplate("{% for m in messages %}")


def test_model_without_template_raises_missing_error(tmp_path: Path) -> None:
    tokenizer = Tokenizer.from_dir(write_tiny_model(tmp_path, {"eos_token": "</s>"}))
    assert tokenizer.chat_template is None
    with pytest.raises(ChatTemplateMissingError, match="no chat template"):
        chat_template_from_tokenizer(tokenizer)


def test_template_list_in_tokenizer_config_uses_default(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    model_dir = write_tiny_model(tmp_path, {"eos_token": "</s>", "chat_template": templates})
    tokenizer = Tokenizer.from_dir(model_dir)
    assert chat_template_from_tokenizer(tokenizer).render([]) == "D</s>"


def test_chat_template_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    write_tiny_model(tmp_path, {"chat_template": "from config"})
    (tmp_path / "chat_template.jinja").write_text("from file")
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert chat_template_from_tokenizer(tokenizer).render([]) == "from file"
