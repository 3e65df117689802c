"""Tools and tool turns reach the model through its template, or in the Hermes convention."""

from __future__ import annotations

import pytest

from testkit.tiny_model import build_tiny_tokenizer
from wire.output_spec import parse_tools
from workers.chat import render_prompt
from workers.tool_parser import ToolCallParser

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALLED = [
    {"role": "user", "content": "Weather in Bern?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'},
            }
        ],
    },
    {"role": "tool", "content": "12 C", "tool_call_id": "call_1"},
]
# A template that knows tools, in the shape of Qwen2's (much reduced).
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def rendered(tokenizer, messages, tools=None) -> str:
    ids = render_prompt(tokenizer, messages, tools)
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def test_without_tool_support_the_tools_go_into_the_system_prompt(tokenizer) -> None:
    text = rendered(tokenizer, CALLED[:1], parse_tools(TOOLS, "auto"))
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '{"type": "function", "function": {"name": "get_weather"' in text
    assert text.endswith("<|im_start|>user\nWeather in Bern?<|im_end|>\n<|im_start|>assistant\n")


def test_an_existing_system_prompt_is_kept_first(tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *CALLED[:1]]
    text = rendered(tokenizer, messages, parse_tools(TOOLS, "required"))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "You must call at least one of these functions." in text


def test_tool_turns_round_trip_as_hermes_blocks(tokenizer) -> None:
    text = rendered(tokenizer, CALLED, parse_tools(TOOLS, "auto"))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>tool\n<tool_response>\n12 C\n</tool_response><|im_end|>" in text
    parser = ToolCallParser()  # what the model is shown is what the worker parses
    assert [s.name for s in parser.push(call) + parser.flush()] == ["get_weather"]


def test_tool_choice_none_shows_no_tools_but_keeps_the_history(tokenizer) -> None:
    text = rendered(tokenizer, CALLED, parse_tools(TOOLS, "none"))
    assert "# Tools" not in text
    assert "<tool_response>\n12 C\n</tool_response>" in text


def test_a_template_that_knows_tools_gets_them_and_arguments_as_objects() -> None:
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    text = rendered(tokenizer, CALLED, parse_tools(TOOLS, "auto"))
    assert text.startswith("TOOLS:get_weather;<user>Weather in Bern?")
    assert '[get_weather {"city": "Bern"}]' in text  # not a JSON string inside JSON
    assert "<tool>12 C" in text
