"""Arbitrary JSON in any field of a chat request never gets a 5xx (design §4).

Hypothesis starts from a valid body and replaces one or more fields of the request schema, top
level or nested, with arbitrary JSON values. Whatever it builds, the gateway answers a 2xx, or a
4xx in OpenAI's error shape naming a field; never a server error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.requests import ChatRequest
from adapters.worker_client import WorkerAdapter
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, gateway_app

# Every field of the request schema, as a path into the body ("*" is the first list item).
FIELDS = [
    ("model",),
    ("messages",),
    ("messages", "*"),
    ("messages", "*", "role"),
    ("messages", "*", "content"),
    ("messages", "*", "content", "*"),
    ("messages", "*", "content", "*", "type"),
    ("messages", "*", "content", "*", "text"),
    ("messages", "*", "name"),
    ("messages", "*", "tool_call_id"),
    ("messages", "*", "tool_calls"),
    ("stream",),
    ("stream_options",),
    ("stream_options", "include_usage"),
    ("max_tokens",),
    ("max_completion_tokens",),
    ("temperature",),
    ("top_p",),
    ("seed",),
    ("stop",),
    ("n",),
    ("logprobs",),
    ("top_logprobs",),
    ("presence_penalty",),
    ("frequency_penalty",),
    ("tools",),
    ("tools", "*"),
    ("tools", "*", "type"),
    ("tools", "*", "function"),
    ("tools", "*", "function", "name"),
    ("tool_choice",),
    ("tool_choice", "type"),
    ("tool_choice", "function"),
    ("tool_choice", "function", "name"),
    ("response_format",),
    ("response_format", "type"),
    ("user",),
    ("metadata",),
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["user", "assistant", "function", "text", "none", "auto", "json_object"]),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def valid_body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Hi"}],
                "name": "u",
                "tool_call_id": "c",
                "tool_calls": [],
            }
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4,
        "temperature": 0.5,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "text"},
    }


def put(body: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set `path` in `body` to `value`, creating containers on the way as needed."""
    node: Any = body
    for i, key in enumerate(path):
        last = i == len(path) - 1
        if key == "*":
            if not isinstance(node, list) or not node:
                return  # an earlier replacement removed the list: nothing to reach
            if last:
                node[0] = value
                return
            node = node[0]
            continue
        if not isinstance(node, dict):
            return
        if last:
            node[key] = value
            return
        child = node.get(key)
        if not isinstance(child, dict | list):
            child = [{}] if path[i + 1] == "*" else {}
            node[key] = child
        node = child


class WorkerRules(ScriptedAdapter):
    """A scripted upstream that refuses what our own workers refuse."""

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return WorkerAdapter.unsupported_param(self, request)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gateway() -> Iterator[tuple[asyncio.AbstractEventLoop, TestClient]]:
    loop = asyncio.new_event_loop()
    adapters = [
        ScriptedAdapter("scripted", text_script(["o", "k"])),
        WorkerRules("worker", text_script(["o", "k"])),
    ]
    client = TestClient(TestServer(gateway_app(adapters=adapters)), loop=loop)
    loop.run_until_complete(client.start_server())
    yield loop, client
    loop.run_until_complete(client.close())
    loop.close()


@settings(
    max_examples=400,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    model=st.sampled_from(["scripted", "worker"]),
    changes=st.lists(st.tuples(st.sampled_from(FIELDS), json_values), min_size=1, max_size=3),
)
def test_arbitrary_json_in_any_field_is_never_a_server_error(gateway, model, changes):
    loop, client = gateway
    body = valid_body(model)
    for path, value in changes:
        put(body, path, value)

    async def send() -> tuple[int, bytes]:
        response = await client.post(
            "/v1/chat/completions",
            data=orjson.dumps(body),
            headers={**AUTH, "Content-Type": "application/json"},
        )
        return response.status, await response.read()

    status, raw = loop.run_until_complete(send())
    assert status < 500, (status, raw, body)
    if status >= 400:
        error = orjson.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["code"], str)
        if status == 400:
            assert error["param"] is None or isinstance(error["param"], str)


def test_tools_and_response_formats_pass_our_workers_rules(gateway):
    """Our workers enforce them (constrained decoding, tool-call parsing): nothing is refused
    as unsupported before the worker sees it."""
    loop, client = gateway
    body = {
        "model": "worker",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_object"},
    }

    async def send() -> int:
        response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
        await response.read()
        return response.status

    assert loop.run_until_complete(send()) == 200
