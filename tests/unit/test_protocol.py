"""Request validation: each bad input is a 400 naming its field; good input keeps its values."""

from __future__ import annotations

import pytest

from gateway.http.errors import APIError
from gateway.protocol import parse_chat_request

USER = [{"role": "user", "content": "Hi"}]


def body(**overrides):
    base = {"model": "m", "messages": USER}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not ...}


BAD = [
    # (overrides, param, code)
    ({"model": ...}, "model", "missing_required_parameter"),
    ({"model": 7}, "model", "invalid_type"),
    ({"model": ""}, "model", "missing_required_parameter"),
    ({"messages": ...}, "messages", "missing_required_parameter"),
    ({"messages": "hi"}, "messages", "invalid_type"),
    ({"messages": []}, "messages", "empty_array"),
    ({"messages": ["hi"]}, "messages[0]", "invalid_type"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
        "invalid_value",
    ),
    ({"temperature": -0.1}, "temperature", "invalid_value"),
    ({"temperature": 2.5}, "temperature", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": True}, "temperature", "invalid_type"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": 2.5}, "max_tokens", "invalid_type"),
    ({"max_completion_tokens": -1}, "max_completion_tokens", "invalid_value"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
    ({"stop": [1]}, "stop", "invalid_type"),
    ({"stop": [""]}, "stop", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "invalid_value"),
    ({"presence_penalty": 3}, "presence_penalty", "invalid_value"),
    ({"frequency_penalty": -2.5}, "frequency_penalty", "invalid_value"),
    ({"seed": "x"}, "seed", "invalid_type"),
    ({"tools": [{"type": "function"}]}, "tools[0]", "invalid_value"),
    (
        {"tools": [{"type": "function", "function": {}}]},
        "tools[0].function.name",
        "missing_required_parameter",
    ),
    ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    # wrong JSON types where a string is looked up in a set: a 400, not a TypeError
    ({"messages": [{"role": [], "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": {}, "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"tool_choice": []}, "tool_choice", "invalid_value"),
    ({"tool_choice": {}}, "tool_choice", "invalid_value"),
    (
        {"tool_choice": {"type": "function", "function": {"name": 5}}},
        "tool_choice.function.name",
        "missing_required_parameter",
    ),
    ({"response_format": {"type": []}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": {}}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({"metadata": {"a": 1}}, "metadata", "invalid_value"),
    ({"user": 5}, "user", "invalid_type"),
    # tool turns: a tool message answers a call by its id; an assistant's calls are OpenAI's shape
    (
        {"messages": [{"role": "tool", "content": "21 C"}]},
        "messages[0].tool_call_id",
        "missing_required_parameter",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": ["call"]}]},
        "messages[0].tool_calls[0]",
        "invalid_value",
    ),
    (
        {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
        "messages[0].tool_calls[0].id",
        "invalid_value",
    ),
    (
        {
            "messages": [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {}}}
                    ],
                }
            ]
        },
        "messages[0].tool_calls[0].function.arguments",
        "invalid_value",
    ),
    ({"continue_final_message": "yes"}, "continue_final_message", "invalid_type"),
    ({"continue_final_message": True}, "continue_final_message", "invalid_value"),
    (
        {
            "messages": [*USER, {"role": "assistant", "content": "Hel"}],
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        "add_generation_prompt",
        "invalid_value",
    ),
    ({"add_generation_prompt": False}, "add_generation_prompt", "invalid_value"),
]


def test_an_open_assistant_message_is_continued():
    messages = [*USER, {"role": "assistant", "content": "Hel"}]
    request = parse_chat_request(
        body(messages=messages, continue_final_message=True, add_generation_prompt=False)
    )
    assert request.continue_final_message
    assert not parse_chat_request(body()).continue_final_message


@pytest.mark.parametrize(("overrides", "param", "code"), BAD)
def test_bad_input_is_a_400_naming_the_field(overrides, param, code):
    with pytest.raises(APIError) as caught:
        parse_chat_request(body(**overrides))
    error = caught.value
    assert error.status == 400
    assert error.param == param
    assert error.code == code
    assert error.body()["error"]["type"] == "invalid_request_error"
    assert param.split("[")[0].split(".")[0] in error.message


ROLES_SUPPORTED = "Supported roles are 'system', 'developer', 'user', 'assistant' and 'tool'."


@pytest.mark.parametrize(
    ("role", "shown"),
    [
        ("r" * 10_000, "'" + "r" * 40 + "…'"),  # cut to its first 40 characters
        ("r" * 40, "'" + "r" * 40 + "'"),  # not cut
        ("robot\x1b[2J", "'robot\\x1b[2J'"),  # a control character escaped
        (["r" * 10_000], "array"),  # anything else: its type alone
        ({"r": "r" * 10_000}, "object"),
    ],
)
def test_a_bad_role_is_repeated_cut_short(role, shown):
    with pytest.raises(APIError) as caught:
        parse_chat_request(body(messages=[{"role": role, "content": "x"}]))
    assert caught.value.message == (
        f"Invalid value for 'messages[0].role': {shown}. {ROLES_SUPPORTED}"
    )


@pytest.mark.parametrize(
    ("part", "shown"),
    [
        ({"type": "t" * 10_000}, "'" + "t" * 40 + "…'"),
        ({"type": ["t" * 10_000]}, "array"),
        ("t" * 10_000, "'string'"),  # not a part at all: its type
    ],
)
def test_an_unsupported_content_part_type_is_repeated_cut_short(part, shown):
    with pytest.raises(APIError) as caught:
        parse_chat_request(body(messages=[{"role": "user", "content": [part]}]))
    assert caught.value.message == (
        f"Unsupported content part type {shown} in 'messages[0].content[0]': only 'text' parts "
        "are supported."
    )


def test_body_must_be_an_object():
    with pytest.raises(APIError) as caught:
        parse_chat_request([1, 2])
    assert caught.value.status == 400


def test_defaults_are_openais():
    chat = parse_chat_request(body())
    assert (chat.temperature, chat.top_p, chat.n, chat.stream, chat.max_tokens) == (
        1.0,
        1.0,
        1,
        False,
        None,
    )
    assert chat.stop == []


def test_values_are_kept_and_unknown_fields_ignored():
    chat = parse_chat_request(
        body(
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=9,
            temperature=0,
            top_p=0.5,
            seed=42,
            stop="END",
            n=2,
            logprobs=True,
            top_logprobs=3,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            user="u1",
            metadata={"k": "v"},
            some_future_field={"x": 1},
        )
    )
    assert chat.stream and chat.include_usage
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.seed) == (9, 0.0, 0.5, 42)
    assert chat.stop == ["END"]
    assert (chat.n, chat.logprobs, chat.top_logprobs) == (2, True, 3)
    assert (chat.presence_penalty, chat.frequency_penalty) == (0.5, -0.5)
    assert chat.metadata == {"k": "v"}


def test_a_named_function_tool_choice_is_openais_valid_form():
    choice = {"type": "function", "function": {"name": "f"}}
    assert parse_chat_request(body(tool_choice=choice)).tool_choice == choice


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_chat_request(body(max_tokens=5, max_completion_tokens=7)).max_tokens == 7


def test_text_parts_are_joined_and_roles_accepted():
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
    ]
    chat = parse_chat_request(body(messages=messages))
    assert [m.role for m in chat.messages] == ["developer", "user", "assistant", "tool"]
    assert chat.messages[1].content == "ab"
    assert chat.messages[2].tool_calls[0]["id"] == "c1"
    assert chat.messages[3].tool_call_id == "c1"


def test_an_integer_written_as_a_json_number_is_an_integer_within_int64():
    assert parse_chat_request(body(max_tokens=8.0, n=2.0, seed=1e3)).max_tokens == 8
    assert parse_chat_request(body(seed=1e3)).seed == 1000
    for value, param in ((1e30, "max_tokens"), (2.5, "max_tokens"), (-1e19, "seed")):
        with pytest.raises(APIError) as refused:
            parse_chat_request(body(**{param: value}))
        assert (refused.value.status, refused.value.param) == (400, param)
