"""Chat messages render through the model's own template into prompt ids."""

from __future__ import annotations

import pytest

from testkit.tiny_model import build_tiny_tokenizer
from workers.chat import ChatTemplateError, render_prompt


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def decoded(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_chatml_prompt_with_generation_prompt(tokenizer) -> None:
    ids = render_prompt(tokenizer, [{"role": "user", "content": "你好 world"}])
    assert (
        decoded(tokenizer, ids) == "<|im_start|>user\n你好 world<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")  # a special token, not text


def test_developer_becomes_system_when_the_template_does_not_know_it(tokenizer) -> None:
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "tool", "content": "42"},
    ]
    text = decoded(tokenizer, render_prompt(tokenizer, messages))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_developer_is_kept_when_the_template_knows_it() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'developer' %}DEV:{% endif %}"
        "{{ m['content'] }}{% endfor %}"
    )
    text = decoded(tokenizer, render_prompt(tokenizer, [{"role": "developer", "content": "x"}]))
    assert text == "DEV:x"


def test_no_template_is_a_clear_error() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_prompt(tokenizer, [{"role": "user", "content": "x"}])


def test_a_template_that_refuses_the_messages_is_a_chat_template_error() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_prompt(tokenizer, [{"role": "user", "content": "x"}])
