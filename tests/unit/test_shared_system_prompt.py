"""A declared shared system prompt, on the gateway's side: which requests open with one, and
that only our own workers are told (design §5)."""

from __future__ import annotations

import orjson
import pytest

from adapters.openai_upstream import upstream_body
from adapters.requests import ChatRequest, Message
from adapters.worker_client import generate_request
from gateway.runs.life import opens_with_shared_prompt

DECLARED = "You are Acme's assistant. Answer briefly."
SHARED = frozenset({DECLARED, "Another declared prompt."})


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([Message("system", DECLARED), Message("user", "Hi")], True),
        ([Message("developer", DECLARED), Message("user", "Hi")], True),
        ([Message("system", DECLARED)], True),
        ([Message("system", DECLARED + " ")], False),  # exactly the text, or nothing
        ([Message("system", DECLARED[:-1])], False),
        ([Message("user", DECLARED)], False),  # a user message is never shared
        ([Message("user", "Hi"), Message("system", DECLARED)], False),  # first message only
        ([Message("system", None)], False),
        ([], False),
    ],
)
def test_only_a_first_system_message_with_a_declared_text_opens_with_one(messages, expected):
    assert opens_with_shared_prompt(messages, SHARED) is expected


def test_nothing_is_shared_when_nothing_is_declared():
    assert not opens_with_shared_prompt([Message("system", DECLARED)], frozenset())


def test_our_workers_are_told_and_openai_compatible_upstreams_are_not():
    chat = ChatRequest("m", [Message("system", DECLARED), Message("user", "Hi")])
    chat.shared_system_prompt = True
    assert orjson.loads(generate_request(chat, "r").to_json())["shared_system_prompt"] is True
    assert "shared_system_prompt" not in upstream_body(chat, "gpt-x")
    chat.shared_system_prompt = False
    assert "shared_system_prompt" not in orjson.loads(generate_request(chat, "r").to_json())
