"""Chat messages render through the model's own template into prompt ids."""

from __future__ import annotations

import pytest

from testkit.tiny_model import build_tiny_tokenizer
from wire.output_spec import parse_tools
from workers.chat import ChatTemplateError, render_prompt, shared_prefix_len


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


SYSTEM = {"role": "system", "content": "You are Acme's assistant. Be brief."}
WEATHER_TOOL = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def shared(tokenizer, messages, tools=None) -> str:
    """The prompt's shared prefix, decoded."""
    ids = render_prompt(tokenizer, messages, tools)
    return decoded(tokenizer, ids[: shared_prefix_len(tokenizer, messages, ids)])


def test_the_shared_prefix_is_the_system_turn_alone(tokenizer) -> None:
    messages = [SYSTEM, {"role": "user", "content": "Hi"}]
    assert shared(tokenizer, messages) == f"<|im_start|>system\n{SYSTEM['content']}<|im_end|>\n"
    developer = [{**SYSTEM, "role": "developer"}, {"role": "user", "content": "Hi"}]
    assert shared(tokenizer, developer) == shared(tokenizer, messages)  # rendered as system


def test_only_a_system_or_developer_message_first_is_shared(tokenizer) -> None:
    assert shared(tokenizer, [{"role": "user", "content": SYSTEM["content"]}, SYSTEM]) == ""


def test_anything_else_in_the_system_turn_means_no_sharing(tokenizer) -> None:
    user = {"role": "user", "content": "Weather in Bern?"}
    offered = parse_tools(WEATHER_TOOL, "auto")
    assert shared(tokenizer, [SYSTEM, user], offered) == ""  # Hermes: tools in the system turn
    hidden = parse_tools(WEATHER_TOOL, "none")
    assert shared(tokenizer, [SYSTEM, user], hidden) == shared(tokenizer, [SYSTEM, user])
    named = build_tiny_tokenizer()
    named.chat_template = (
        "{% for m in messages %}<{{ m.role }}{% if m.name %} {{ m.name }}{% endif %}>"
        "{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    assert shared(named, [SYSTEM, user]) == "<system>You are Acme's assistant. Be brief.\n"
    assert shared(named, [{**SYSTEM, "name": "acme-ops"}, user]) == ""


def test_a_template_that_will_not_render_a_system_turn_alone_shares_nothing() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = (
        "{% if messages | length < 2 %}{{ raise_exception('a user turn is required') }}{% endif %}"
        "{% for m in messages %}{{ m.content }}\n{% endfor %}"
    )
    assert shared(tokenizer, [SYSTEM, {"role": "user", "content": "Hi"}]) == ""


def test_a_final_assistant_message_is_left_open_to_continue(tokenizer) -> None:
    user = {"role": "user", "content": "Hi"}
    opened = render_prompt(tokenizer, [user, {"role": "assistant", "content": "Hel "}], None, True)
    # no end of turn after it, its trailing space kept, no new turn begun
    assert (
        decoded(tokenizer, opened) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHel "
    )
    empty = render_prompt(tokenizer, [user, {"role": "assistant", "content": ""}], None, True)
    assert empty == render_prompt(tokenizer, [user])
