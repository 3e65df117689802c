"""Arbitrary JSON in any field of a chat request never gets a 5xx (design §4).

Hypothesis starts from a valid body and replaces one or more fields of the request schema, top
level or nested, with arbitrary JSON values. Whatever it builds, the gateway answers a 2xx, or a
4xx in OpenAI's error shape naming a field; never a server error. A second property aims at the
JSON Schemas a request carries (a tool's parameters, a response format's schema), with values
built from JSON Schema's own keywords.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapters.events import Event
from adapters.requests import ChatRequest
from adapters.worker_client import WorkerAdapter, generate_request
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
    ("messages", "*", "tool_calls", "*"),
    ("messages", "*", "tool_calls", "*", "id"),
    ("messages", "*", "tool_calls", "*", "type"),
    ("messages", "*", "tool_calls", "*", "function"),
    ("messages", "*", "tool_calls", "*", "function", "name"),
    ("messages", "*", "tool_calls", "*", "function", "arguments"),
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
    ("tools", "*", "function", "description"),
    ("tools", "*", "function", "parameters"),
    ("tools", "*", "function", "parameters", "$schema"),
    ("tools", "*", "function", "parameters", "type"),
    ("tools", "*", "function", "parameters", "properties"),
    ("tools", "*", "function", "parameters", "properties", "city"),
    ("tool_choice",),
    ("tool_choice", "type"),
    ("tool_choice", "function"),
    ("tool_choice", "function", "name"),
    ("response_format",),
    ("response_format", "type"),
    ("response_format", "json_schema"),
    ("response_format", "json_schema", "name"),
    ("response_format", "json_schema", "strict"),
    ("response_format", "json_schema", "schema"),
    ("response_format", "json_schema", "schema", "$schema"),
    ("response_format", "json_schema", "schema", "type"),
    ("response_format", "json_schema", "schema", "properties"),
    ("user",),
    ("metadata",),
]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(
        [
            "user",
            "assistant",
            "function",
            "text",
            "none",
            "auto",
            "json_object",
            "json_schema",
            "object",
            "string",
            "f",
        ]
    ),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)

# Where a request carries a JSON Schema (or a keyword of one).
SCHEMA_FIELDS = [
    ("tools", "*", "function", "parameters"),
    ("tools", "*", "function", "parameters", "$schema"),
    ("tools", "*", "function", "parameters", "properties", "city"),
    ("response_format", "json_schema", "schema"),
    ("response_format", "json_schema", "schema", "$schema"),
    ("response_format", "json_schema", "schema", "properties", "city"),
]
SCHEMA_KEYWORDS = ["$schema", "$id", "$ref", "$defs", "type", "properties", "items", "not", "enum"]
DIALECTS = [
    "https://json-schema.org/draft/2020-12/schema",
    "http://json-schema.org/draft-07/schema#",
    "http://json-schema.org/draft-04/schema#",
    "#",
    "#/$defs/a",
]
schema_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["object", "string", "array", *DIALECTS]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(SCHEMA_KEYWORDS) | st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def valid_body(model: str) -> dict[str, Any]:
    """A request every model accepts, using every field FIELDS names (see the test below)."""
    return {
        "model": model,
        "messages": [
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "Hi"}],
                "name": "u",
                "tool_call_id": "c",
                "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            }
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 4,
        "temperature": 0.5,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": "d",
                    "parameters": {
                        "$schema": "https://json-schema.org/draft/2020-12/schema",
                        "type": "object",
                        "properties": {"city": {"type": "string"}},
                    },
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "s",
                "strict": True,
                "schema": {
                    "$schema": "https://json-schema.org/draft/2020-12/schema",
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                },
            },
        },
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
    """A scripted upstream that refuses what our own workers refuse, and builds the body our
    worker adapter would send (so a shape that adapter cannot take is its 400, not a crash)."""

    def unsupported_param(self, request: ChatRequest) -> str | None:
        return WorkerAdapter.unsupported_param(self, request)  # type: ignore[arg-type]

    async def stream(self, request: ChatRequest, request_id: str) -> AsyncIterator[list[Event]]:
        generate_request(request, request_id).to_json()
        async for batch in super().stream(request, request_id):
            yield batch


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


def post(gateway: tuple[asyncio.AbstractEventLoop, TestClient], body: Any) -> tuple[int, bytes]:
    """The status and whole body of the gateway's answer to `body`."""
    loop, client = gateway

    async def send() -> tuple[int, bytes]:
        response = await client.post(
            "/v1/chat/completions",
            data=orjson.dumps(body),
            headers={**AUTH, "Content-Type": "application/json"},
        )
        return response.status, await response.read()

    return loop.run_until_complete(send())


@pytest.mark.parametrize("model", ["scripted", "worker"])
def test_the_starting_body_is_accepted(gateway, model):
    """Every replacement starts from a request that reaches the model, so each field's check
    (not an earlier refusal) is what meets the arbitrary value."""
    status, raw = post(gateway, valid_body(model))
    assert status == 200, raw
    assert raw.endswith(b"data: [DONE]\n\n")


def assert_never_a_server_error(gateway, body: dict[str, Any]) -> None:
    """A 2xx, or a 4xx in OpenAI's error shape (a 400 naming a field or none)."""
    status, raw = post(gateway, body)
    assert status < 500, (status, raw, body)
    if status >= 400:
        error = orjson.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert isinstance(error["code"], str)
        if status == 400:
            assert error["param"] is None or isinstance(error["param"], str)


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
    body = valid_body(model)
    for path, value in changes:
        put(body, path, value)
    assert_never_a_server_error(gateway, body)


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    model=st.sampled_from(["scripted", "worker"]),
    path=st.sampled_from(SCHEMA_FIELDS),
    value=schema_values,
)
def test_arbitrary_json_in_a_schema_is_never_a_server_error(gateway, model, path, value):
    """The schemas are compiled by a JSON Schema library, whose own failures must be refusals."""
    body = valid_body(model)
    put(body, path, value)
    assert_never_a_server_error(gateway, body)


def test_tools_and_response_formats_pass_our_workers_rules(gateway):
    """Our workers enforce them (constrained decoding, tool-call parsing): nothing is refused
    as unsupported before the worker sees it."""
    body = {
        "model": "worker",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {"type": "json_object"},
    }
    assert post(gateway, body)[0] == 200
