"""The Messages request as the chat body it asks for (gateway/anthropic/request.py)."""

from __future__ import annotations

import pytest

from gateway.anthropic.request import chat_body, messages_request, renamed
from gateway.http.errors import APIError
from gateway.protocol import parse_chat_request


def make_request(**fields) -> dict:
    body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "Hi"}]}
    body.update(fields)
    return body


def refusal(body) -> APIError:
    with pytest.raises(APIError) as info:
        parse_chat_request(chat_body(body))
    return renamed(info.value)


def test_a_plain_request_is_a_chat_request():
    chat = chat_body(make_request(temperature=0.5, top_p=0.9, stop_sequences=["END"]))
    assert chat == {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 32,
        "stream": False,
        "temperature": 0.5,
        "top_p": 0.9,
        "stop": ["END"],
    }
    parsed = parse_chat_request(chat)
    assert (parsed.max_tokens, parsed.stop, parsed.temperature) == (32, ["END"], 0.5)


def test_system_string_or_blocks_is_the_first_message():
    blocks = [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]
    for system in ("Be brief.", blocks):
        messages = chat_body(make_request(system=system))["messages"]
        assert messages[0] == {"role": "system", "content": "Be brief."}


def test_text_blocks_join_into_one_message():
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    messages = chat_body(make_request(messages=[{"role": "user", "content": content}]))
    assert messages["messages"] == [{"role": "user", "content": "ab"}]


def test_tool_use_and_tool_result_are_the_chat_tool_turns():
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "P"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    messages = chat_body(make_request(messages=turns))["messages"]
    assert messages[1:] == [
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city":"P"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    parse_chat_request(chat_body(make_request(messages=turns)))


def test_tools_and_tool_choices_map_to_the_chats():
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"name": "weather", "description": "Forecast", "input_schema": schema}]
    chat = chat_body(make_request(tools=tools, tool_choice={"type": "any"}))
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "weather", "parameters": schema, "description": "Forecast"},
        }
    ]
    assert chat["tool_choice"] == "required"
    named = chat_body(make_request(tools=tools, tool_choice={"type": "tool", "name": "weather"}))
    assert named["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    for kind in ("auto", "none"):
        assert chat_body(make_request(tool_choice={"type": kind}))["tool_choice"] == kind


def test_top_k_rides_beside_the_chat_fields():
    chat_json, chat = messages_request(make_request(top_k=5))
    assert (chat_json["top_k"], chat.top_k) == (5, 5)
    chat_json, chat = messages_request(make_request())
    assert ("top_k" in chat_json, chat.top_k) == (False, 0)


def test_metadata_user_id_is_the_chats_user():
    assert chat_body(make_request(metadata={"user_id": "u-1"}))["user"] == "u-1"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"temperature": 1.5}, "temperature"),
        ({"metadata": {"user_id": "u", "team": "x"}}, "metadata.team"),
        (
            {"tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
            "tool_choice.disable_parallel_tool_use",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "base64"}}],
                    }
                ]
            },
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0].cache_control",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(fields, param):
    error = refusal(make_request(**fields))
    assert (error.status, error.param) == (400, param)


def test_chat_parser_errors_come_back_with_messages_names():
    assert refusal(make_request(stop_sequences=[""])).param == "stop_sequences"
    assert refusal(make_request(max_tokens=0)).param == "max_tokens"
    assert refusal(make_request(metadata={"user_id": 3})).param == "metadata.user_id"
