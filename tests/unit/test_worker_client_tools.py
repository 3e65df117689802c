"""The worker adapter passes response formats and tools on, and turns `tool_call` lines into
tool-call deltas; against the real worker app, a forced call ends as an OpenAI completion with
`tool_calls` and finish reason `tool_calls`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import orjson
import pytest

from adapters.chat_chunks import CompletionBuilder
from adapters.events import Finish, ToolCallDelta
from adapters.requests import ChatRequest, Message
from adapters.worker_client import WorkerAdapter, generate_request, to_event
from tests.support.waiting import until
from wire import api
from wire.generate_body import parse_generate
from workers.config import WorkerConfig
from workers.server import create_worker_app

PARAMS = {
    "type": "object",
    "properties": {"city": {"enum": ["Bern", "Basel"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
HISTORY = [
    Message("user", "Weather?"),
    Message(
        "assistant",
        None,
        tool_calls=[
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Bern"}'},
            }
        ],
    ),
    Message("tool", "12 C", tool_call_id="call_1"),
]


def chat(**overrides) -> ChatRequest:
    return ChatRequest("m", list(HISTORY), max_tokens=200, seed=5, **overrides)


def test_the_body_carries_format_tools_and_tool_turns_and_parses_back() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMS, "strict": True}}
    built = generate_request(chat(tools=TOOLS, tool_choice="auto", response_format=fmt), "r1")
    parsed = parse_generate(orjson.loads(built.to_json()))
    assert (parsed.response_format, parsed.tools) == (built.response_format, built.tools)
    assert parsed.response_format.wire() == fmt
    assert parsed.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": HISTORY[1].tool_calls,
    }
    assert parsed.messages[2] == {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}


def test_a_tool_call_line_is_a_whole_delta_with_an_openai_id() -> None:
    event = to_event(api.ToolCallLine(0, '{"city":"Bern"}', "get_weather", 1, 9))
    assert isinstance(event, ToolCallDelta)
    assert (event.index, event.call_index, event.name, event.arguments) == (
        1,
        0,
        "get_weather",
        '{"city":"Bern"}',
    )
    assert event.id.startswith("call_") and len(event.id) > 20
    assert to_event(api.FinishLine("tool_calls", 1, 9)) == Finish("tool_calls", 1)


def test_the_worker_adapter_refuses_none_of_them() -> None:
    adapter = WorkerAdapter("http://127.0.0.1:1")
    request = chat(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert adapter.unsupported_param(request) is None


@pytest.fixture
async def adapter(aiohttp_client, loaded, tiny_model_dir) -> AsyncIterator[WorkerAdapter]:
    config = WorkerConfig(model=str(tiny_model_dir), device="cpu", dtype="float32")
    client = await aiohttp_client(create_worker_app(config, loaded=loaded))

    async def healthy() -> bool:
        return (await client.get("/health")).status == 200

    await until(healthy, "the worker app to become healthy")
    adapter = WorkerAdapter(str(client.make_url("/")))
    await adapter.start()
    yield adapter
    await adapter.close()


async def test_a_forced_call_becomes_a_completion_with_tool_calls(adapter) -> None:
    builder = CompletionBuilder(1)
    async for batch in adapter.stream(chat(tools=TOOLS, tool_choice="required"), "forced-1"):
        for event in batch:
            builder.add(event)
    completion = orjson.loads(builder.build("chatcmpl-1", "tiny", 0))
    [choice] = completion["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Bern", "Basel")
