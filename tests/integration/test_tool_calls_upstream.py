"""Tool calls through the real gateway in front of the scripted OpenAI-compatible upstream: a call
streamed in fragments reaches the client whole and valid, an invalid one ends the run with an
error frame, and a tool round trip works through the `openai` client."""

from __future__ import annotations

import json

import orjson
import pytest
from openai import AsyncOpenAI

from testkit.scripted_upstream import sse, tool_call_script
from tests.support.gateway import API_KEY, AUTH, chat_body, gateway_app, stream_payloads

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}
ARGUMENTS = '{"city": "Paris", "unit": "C", "note": "fragmented over twenty chunks"}'
SECRET = "model-output-91c2"


@pytest.fixture
async def gateway(upstream, aiohttp_client):
    _, url = upstream
    models = ["tools", "bad-json", "bad-schema", "unknown", "round-trip"]
    app = gateway_app(upstream=[f"{m}={url}" for m in models], disconnect_grace=0)
    return await aiohttp_client(app)


def calls_script(
    model: str, *calls: tuple[str, str, str], finish: str | None = "tool_calls"
) -> list:
    return tool_call_script("chatcmpl-up", model, list(calls), pieces=20, finish=finish)


async def post(client, model: str, **body):
    body = chat_body(model, tools=[WEATHER], **body)
    return await client.post("/v1/chat/completions", json=body, headers=AUTH)


def tool_call_deltas(payloads: list) -> list[dict]:
    return [
        call
        for p in payloads
        if isinstance(p, dict) and "choices" in p
        for c in p["choices"]
        for call in c["delta"].get("tool_calls") or ()
    ]


async def test_twenty_fragments_arrive_as_one_complete_call(gateway, upstream):
    state, _ = upstream
    state.scripts["tools"] = calls_script("tools", ("call_w1", "get_weather", ARGUMENTS))
    payloads = stream_payloads(await (await post(gateway, "tools", stream=True)).read())
    assert tool_call_deltas(payloads) == [
        {
            "index": 0,
            "id": "call_w1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": ARGUMENTS},
        }
    ]
    assert payloads[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert payloads[-1] == "[DONE]"
    assert state.records[-1].body["tools"] == [WEATHER]


async def test_the_final_object_holds_the_call_and_the_upstreams_stop_becomes_tool_calls(
    gateway, upstream
):
    state, _ = upstream
    state.scripts["tools"] = calls_script(
        "tools", ("call_w1", "get_weather", ARGUMENTS), finish="stop"
    )
    resp = await post(gateway, "tools")
    assert resp.status == 200
    (choice,) = (await resp.json())["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_w1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": ARGUMENTS},
            }
        ],
    }


@pytest.mark.parametrize(
    ("model", "name", "arguments"),
    [
        ("bad-json", "get_weather", '{"city": "' + SECRET),
        ("bad-schema", "get_weather", f'{{"unit": "{SECRET}"}}'),
        ("unknown", "launch", "{}"),
    ],
)
async def test_an_invalid_call_ends_the_stream_with_an_error_and_done(
    gateway, upstream, model, name, arguments
):
    state, _ = upstream
    state.scripts[model] = calls_script(model, ("call_x", name, arguments))
    raw = await (await post(gateway, model, stream=True)).read()
    assert SECRET.encode() not in raw
    payloads = stream_payloads(raw)
    assert tool_call_deltas(payloads) == []  # never half a call
    assert payloads[-1] == "[DONE]"
    error = payloads[-2]["error"]
    assert error["code"] == "invalid_tool_call"
    assert f"'{name}'" in error["message"]
    resp = await post(gateway, model)  # not streamed: the same error as the HTTP answer
    assert resp.status == 502
    assert (await resp.json())["error"]["code"] == "invalid_tool_call"


async def test_a_stream_that_ends_without_a_finish_still_releases_its_call(gateway, upstream):
    state, _ = upstream
    state.scripts["tools"] = calls_script("tools", ("c1", "get_weather", ARGUMENTS), finish=None)
    payloads = stream_payloads(await (await post(gateway, "tools", stream=True)).read())
    assert [c["function"]["arguments"] for c in tool_call_deltas(payloads)] == [ARGUMENTS]
    assert payloads[-2]["choices"][0]["finish_reason"] == "tool_calls"


async def test_a_bad_call_in_a_stream_without_a_finish_still_fails_the_run(gateway, upstream):
    state, _ = upstream
    state.scripts["bad-json"] = calls_script("bad-json", ("c1", "get_weather", "{"), finish=None)
    payloads = stream_payloads(await (await post(gateway, "bad-json", stream=True)).read())
    assert tool_call_deltas(payloads) == []
    assert payloads[-2]["error"]["code"] == "invalid_tool_call"


async def test_an_invalid_schema_is_refused_before_the_run(gateway, upstream):
    state, _ = upstream
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}
    body = chat_body("tools", tools=[WEATHER, tool])
    resp = await gateway.post("/v1/chat/completions", json=body, headers=AUTH)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == "tools[1].function.parameters"
    assert state.records == []


def round_trip(body: dict) -> list:
    """A tool call first; once the conversation holds the tool's answer, text."""
    if body["messages"][-1]["role"] != "tool":
        return calls_script("round-trip", ("call_rt", "get_weather", '{"city": "Oslo"}'))
    words = ["It is ", "sunny ", "in Oslo."]
    out = [sse({"choices": [{"index": 0, "delta": {"content": w}}]}) for w in words]
    out.append(sse({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    return [*out, b"data: [DONE]\n\n"]


async def test_a_tool_round_trip_through_the_openai_client(gateway, upstream):
    state, _ = upstream
    state.scripts["round-trip"] = round_trip
    client = AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key=API_KEY, max_retries=0)
    messages: list = [{"role": "user", "content": "Weather in Oslo?"}]
    first = await client.chat.completions.create(
        model="round-trip", messages=messages, tools=[WEATHER]
    )
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name) == ("call_rt", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Oslo"}

    messages += [choice.message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    stream = await client.chat.completions.create(
        model="round-trip", messages=messages, tools=[WEATHER], stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "It is sunny in Oslo."
    sent = state.records[-1].body["messages"]
    assert sent[1] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_rt",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
            }
        ],
    }
    assert sent[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_rt"}
    await client.close()


async def test_streamed_call_assembles_in_the_openai_clients_stream_helper(gateway, upstream):
    state, _ = upstream
    state.scripts["tools"] = calls_script("tools", ("call_w1", "get_weather", ARGUMENTS))
    client = AsyncOpenAI(base_url=str(gateway.make_url("/v1")), api_key=API_KEY, max_retries=0)
    async with client.chat.completions.stream(
        model="tools", messages=[{"role": "user", "content": "Hi"}], tools=[WEATHER]
    ) as stream:
        completion = await stream.get_final_completion()
    (call,) = completion.choices[0].message.tool_calls
    assert orjson.loads(call.function.arguments) == orjson.loads(ARGUMENTS)
    assert completion.choices[0].finish_reason == "tool_calls"
    await client.close()
