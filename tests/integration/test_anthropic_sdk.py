"""The real `anthropic` SDK, unchanged, against the gateway's Messages routes (design §11).

The gateway runs from the app factory in front of a scripted in-process backend; the SDK talks
to it over real HTTP with its own client, decoder and types, so every event and object here is
one the SDK itself parsed.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import pytest
import tomlkit
from aiohttp import web

from adapters.events import Accepted, Finish, TextDelta, ToolCallDelta, Usage
from adapters.requests import ChatRequest
from gateway.app_keys import RUNS
from gateway.runs.status import RunStatus
from policies.tenants_file import create_key
from testkit.scripted_adapter import ScriptedAdapter
from testkit.scripted_upstream import sse
from tests.support.gateway import API_KEY, gateway_app
from tests.support.waiting import until

WEATHER = {
    "name": "weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def scripted(request: ChatRequest) -> list:
    """Text for a plain turn; with tools offered, one `weather` call, then after its result a
    sentence naming what the tool answered."""
    last = request.messages[-1]
    if last.role == "tool":
        return [TextDelta("It is "), TextDelta(last.content), Finish("stop"), Usage(20, 3)]
    if request.tools:
        return [
            TextDelta("Checking."),
            ToolCallDelta(0, '{"city": "Paris"}', "call_w1", "weather"),
            Finish("tool_calls"),
            Usage(12, 9),
        ]
    return [TextDelta("Hello"), TextDelta(" there"), Finish("stop"), Usage(5, 2)]


@pytest.fixture
async def base_url(aiohttp_client):
    client = await aiohttp_client(gateway_app([ScriptedAdapter("claude-ish", scripted)]))
    return str(client.make_url("")).rstrip("/")


def sdk(base_url: str, **options) -> anthropic.AsyncAnthropic:
    options.setdefault("api_key", API_KEY)
    return anthropic.AsyncAnthropic(base_url=base_url, max_retries=0, **options)


HI = [{"role": "user", "content": "Hi"}]


async def test_create_answers_a_message(base_url):
    message = await sdk(base_url).messages.create(model="claude-ish", max_tokens=64, messages=HI)
    assert isinstance(message, anthropic.types.Message)
    assert message.id.startswith("msg_")
    assert message._request_id.startswith("req_")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "Hello there"
    assert (message.stop_reason, message.stop_sequence) == ("end_turn", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (5, 2)


async def test_the_sync_client_streams_too(base_url):
    def converse() -> tuple[str, str]:
        client = anthropic.Anthropic(base_url=base_url, api_key=API_KEY, max_retries=0)
        with client.messages.stream(model="claude-ish", max_tokens=8, messages=HI) as stream:
            text = "".join(stream.text_stream)
            return text, stream.get_final_message().stop_reason

    assert await asyncio.to_thread(converse) == ("Hello there", "end_turn")


async def test_bearer_auth_serves_too_and_a_bad_key_is_an_authentication_error(base_url):
    bearer = anthropic.AsyncAnthropic(base_url=base_url, auth_token=API_KEY, max_retries=0)
    message = await bearer.messages.create(model="claude-ish", max_tokens=8, messages=HI)
    assert message.content[0].text == "Hello there"
    with pytest.raises(anthropic.AuthenticationError) as info:
        await sdk(base_url, api_key="sk-wrong").messages.create(
            model="claude-ish", max_tokens=8, messages=HI
        )
    assert info.value.body["error"]["type"] == "authentication_error"


async def test_stream_events_in_anthropics_order_each_parsed_by_the_sdk(base_url):
    client = sdk(base_url)
    async with client.messages.stream(model="claude-ish", max_tokens=64, messages=HI) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    raw = [e.type for e in events if e.type not in ("text",)]  # `text`: the helper's own
    assert raw == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.content[0].text == "Hello there"
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 2


async def test_raw_stream_with_stream_true(base_url):
    stream = await sdk(base_url).messages.create(
        model="claude-ish", max_tokens=64, messages=HI, stream=True
    )
    events = [event async for event in stream]
    assert isinstance(events[0], anthropic.types.RawMessageStartEvent)
    assert isinstance(events[-1], anthropic.types.RawMessageStopEvent)
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == "Hello there"


async def test_tool_use_round_trip(base_url):
    client = sdk(base_url)
    turns: list = [{"role": "user", "content": "Weather in Paris?"}]
    first = await client.messages.create(
        model="claude-ish", max_tokens=64, messages=turns, tools=[WEATHER]
    )
    assert first.stop_reason == "tool_use"
    call = first.content[-1]
    assert isinstance(call, anthropic.types.ToolUseBlock)
    assert (call.name, call.input) == ("weather", {"city": "Paris"})
    turns += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
        },
    ]
    second = await client.messages.create(
        model="claude-ish", max_tokens=64, messages=turns, tools=[WEATHER]
    )
    assert second.content[0].text == "It is sunny"


async def test_streamed_tool_use_arrives_whole(base_url):
    client = sdk(base_url)
    async with client.messages.stream(
        model="claude-ish",
        max_tokens=64,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[WEATHER],
        tool_choice={"type": "any"},
    ) as stream:
        partial = "".join([e.partial_json async for e in stream if e.type == "input_json"])
        final = await stream.get_final_message()
    assert json.loads(partial) == {"city": "Paris"}
    assert final.content[-1].input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


async def test_count_tokens_of_a_backend_that_cannot_count_is_the_gateways_estimate(base_url):
    client = sdk(base_url)
    raw = await client.messages.with_raw_response.count_tokens(model="claude-ish", messages=HI)
    assert raw.headers["x-sluice-token-count"] == "estimate"
    count = await raw.parse()
    assert count.input_tokens == 3 + 1 + 4  # policies/quotas.py: "Hi" is one third-token


async def test_unsupported_fields_are_bad_request_errors_naming_them(base_url):
    client = sdk(base_url)
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(
            model="claude-ish",
            max_tokens=8,
            messages=HI,
            extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}},
        )
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert info.value.body["error"]["message"].startswith("thinking")
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    with pytest.raises(anthropic.BadRequestError) as info:
        await client.messages.create(
            model="claude-ish", max_tokens=8, messages=[{"role": "user", "content": [image]}]
        )
    assert info.value.body["error"]["message"].startswith("messages[0].content[0].type")
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="no-such-model", max_tokens=8, messages=HI)


async def test_rate_limit_is_a_rate_limit_error(aiohttp_client, tmp_path):
    path = tmp_path / "tenants.toml"
    path.write_text(tomlkit.dumps({"tenants": {"acme": {"rpm": 1}}}), encoding="utf-8")
    key, _ = create_key(path, "acme")
    app = gateway_app([ScriptedAdapter("claude-ish", scripted)], tenants=str(path), api_key=[])
    client = await aiohttp_client(app)
    api = sdk(str(client.make_url("")).rstrip("/"), api_key=key)
    await api.messages.create(model="claude-ish", max_tokens=8, messages=HI)
    with pytest.raises(anthropic.RateLimitError) as info:
        await api.messages.create(model="claude-ish", max_tokens=8, messages=HI)
    assert info.value.body["error"]["type"] == "rate_limit_error"
    assert info.value.response.headers.get("retry-after")


def slow(request: ChatRequest) -> list:
    """One token, then a long pause: a run still live when its client goes away."""
    return [TextDelta("first"), 30.0, TextDelta("never"), Finish("stop"), Usage(5, 2)]


async def test_a_dropped_stream_cancels_its_run(aiohttp_client):
    adapter = ScriptedAdapter("slow", slow)
    client = await aiohttp_client(gateway_app([adapter], disconnect_grace=0))
    api = sdk(str(client.make_url("")).rstrip("/"))
    stream = await api.messages.create(model="slow", max_tokens=8, messages=HI, stream=True)
    run_id = stream.response.headers["x-sluice-run-id"]
    events = stream.__aiter__()
    assert (await anext(events)).type == "message_start"
    assert (await anext(events)).type == "content_block_start"
    await stream.close()
    runs = client.server.app[RUNS]

    async def ended():
        return (await runs.get(run_id)).terminal

    terminal = await until(ended, "the dropped stream's run to end")
    assert terminal.status is RunStatus.CANCELLED
    assert terminal.cause == "cancel:disconnect"
    assert adapter.aborted == {run_id: True}


def failing(request: ChatRequest) -> list:
    """A backend that fails after its first token."""
    return [TextDelta("partial"), RuntimeError("backend detail that must not leak")]


async def test_a_failure_mid_stream_is_an_error_event(aiohttp_client):
    client = await aiohttp_client(gateway_app([ScriptedAdapter("failing", failing)]))
    api = sdk(str(client.make_url("")).rstrip("/"))
    stream = await api.messages.create(model="failing", max_tokens=8, messages=HI, stream=True)
    seen = []
    with pytest.raises(anthropic.APIStatusError) as info:
        async for event in stream:
            seen.append(event.type)
    assert seen[:2] == ["message_start", "content_block_start"]
    assert "message_stop" not in seen
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "api_error"
    assert "backend detail" not in info.value.body["error"]["message"]


async def test_no_ready_backend_is_an_overloaded_error(aiohttp_client):
    client = await aiohttp_client(gateway_app([ScriptedAdapter("down", scripted, ready=False)]))
    api = sdk(str(client.make_url("")).rstrip("/"))
    with pytest.raises(anthropic.OverloadedError) as info:
        await api.messages.create(model="down", max_tokens=8, messages=HI)
    assert info.value.status_code == 529
    assert info.value.body["error"]["type"] == "overloaded_error"
    assert info.value.response.headers["retry-after"]


async def test_the_stream_on_the_wire(aiohttp_client):
    client = await aiohttp_client(gateway_app([ScriptedAdapter("claude-ish", scripted)]))
    body = {"model": "claude-ish", "max_tokens": 8, "messages": HI, "stream": True}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    resp = await client.post("/v1/messages", json=body, headers=headers)
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    raw = await resp.read()
    frames = raw.split(b"\n\n")
    assert frames[0].startswith(b"retry: 1000\nevent: message_start\ndata: {")
    assert frames[2] == b'event: ping\ndata: {"type":"ping"}'
    assert frames[-2] == b'event: message_stop\ndata: {"type":"message_stop"}'
    assert frames[-1] == b""  # no `[DONE]`
    names = [f.split(b"\n")[-2] for f in frames[:-1]]
    assert all(name.startswith(b"event: ") for name in names)


# -- stop sequences, message_start's usage, and who counts ----------------------------------

STOP = "\n\nHuman:"


def stopping(request: ChatRequest) -> list:
    """A backend that counts the prompt on accepting the run and names the stop string."""
    return [
        Accepted(prompt_tokens=11),
        TextDelta("Once upon"),
        Finish("stop", 0, STOP),
        Usage(11, 3),
    ]


async def test_a_matched_stop_sequence_is_reported_stream_and_not(aiohttp_client):
    client = await aiohttp_client(gateway_app([ScriptedAdapter("stops", stopping)]))
    api = sdk(str(client.make_url("")).rstrip("/"))
    options = {"model": "stops", "max_tokens": 64, "messages": HI, "stop_sequences": [STOP]}
    message = await api.messages.create(**options)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", STOP)
    async with api.messages.stream(**options) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    [delta] = [e for e in events if e.type == "message_delta"]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("stop_sequence", STOP)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", STOP)
    assert events[0].message.usage.input_tokens == 11 == final.usage.input_tokens


async def test_message_start_has_the_estimate_where_the_backend_counts_only_at_the_end(base_url):
    stream = await sdk(base_url).messages.create(
        model="claude-ish", max_tokens=8, messages=HI, stream=True
    )
    events = [event async for event in stream]
    assert events[0].message.usage.input_tokens == 3 + 1 + 4  # the estimate, as counted below
    assert events[-2].usage.input_tokens == 5  # the backend's own count, at the end


def finishing(delta: dict, finish: str | None = None, **extra) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
    return sse(
        {
            "id": "x",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [choice],
        }
    )


async def test_an_upstreams_stop_reason_is_the_stop_sequence(aiohttp_client, upstream):
    state, url = upstream
    usage = {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8}
    state.scripts["vllmish"] = [
        finishing({"role": "assistant", "content": ""}),
        finishing({"content": "Once upon"}),
        finishing({}, "stop", stop_reason=STOP),
        sse(
            {
                "id": "x",
                "object": "chat.completion.chunk",
                "created": 1,
                "model": "m",
                "choices": [],
                "usage": usage,
            }
        ),
        b"data: [DONE]\n\n",
    ]
    client = await aiohttp_client(gateway_app(upstream=[f"vllmish={url}"]))
    api = sdk(str(client.make_url("")).rstrip("/"))
    options = {"model": "vllmish", "max_tokens": 8, "messages": HI, "stop_sequences": [STOP]}
    async with api.messages.stream(**options) as stream:
        final = await stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", STOP)
    assert final.usage.input_tokens == 6
    assert state.records[-1].body["stop"] == [STOP]


@pytest.fixture
async def tokenizer(aiohttp_server):
    """An OpenAI-compatible server's `/tokenize` (vLLM's), answering `status`; what it was
    asked, in order."""
    asked: list[dict] = []
    status = {"code": 200}

    async def tokenize(request: web.Request) -> web.Response:
        asked.append(await request.json())
        if status["code"] != 200:
            return web.json_response({"detail": "Not Found"}, status=status["code"])
        return web.json_response({"count": 42, "max_model_len": 4096, "tokens": []})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "vllmish"}]})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/v1/models", models)
    server = await aiohttp_server(app)
    return asked, status, f"http://127.0.0.1:{server.port}/v1"


async def count_raw(client, model: str, **extra):
    api = sdk(str(client.make_url("")).rstrip("/"))
    raw = await api.messages.with_raw_response.count_tokens(model=model, messages=HI, **extra)
    return raw.headers["x-sluice-token-count"], (await raw.parse()).input_tokens


async def test_an_upstream_with_tokenize_counts_and_one_without_is_estimated(
    aiohttp_client, tokenizer
):
    asked, status, url = tokenizer
    client = await aiohttp_client(gateway_app(upstream=[f"vllmish={url}"]))
    assert await count_raw(client, "vllmish", system="Be brief.") == ("upstream", 42)
    assert asked[0] == {
        "model": "vllmish",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    }
    status["code"] = 404  # a server with no /tokenize: estimated, and not asked again
    assert await count_raw(client, "vllmish") == ("estimate", 8)
    assert await count_raw(client, "vllmish") == ("estimate", 8)
    assert len(asked) == 2


async def test_the_scripted_upstream_has_no_tokenize_so_its_count_is_an_estimate(
    aiohttp_client, upstream
):
    _, url = upstream
    client = await aiohttp_client(gateway_app(upstream=[f"scripted={url}"]))
    assert await count_raw(client, "scripted") == ("estimate", 8)


def late(request: ChatRequest) -> list:
    """A backend that takes a while to accept the run (as one waiting for capacity would)."""
    return [0.3, Accepted(prompt_tokens=11), TextDelta("Hi"), Finish("stop"), Usage(11, 1)]


async def test_a_run_not_yet_accepted_gets_pings_then_message_start_with_its_count(
    aiohttp_client,
):
    client = await aiohttp_client(gateway_app([ScriptedAdapter("late", late)], ping_interval=0.05))
    body = {"model": "late", "max_tokens": 8, "messages": HI, "stream": True}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    raw = await (await client.post("/v1/messages", json=body, headers=headers)).read()
    before, start = raw.split(b"event: message_start\n", 1)
    assert b": ping" in before and b"event:" not in before
    assert b'"usage":{"input_tokens":11,"output_tokens":0}' in start.split(b"\n\n")[0]


async def test_a_repeated_idempotency_key_replays_the_same_events(aiohttp_client):
    client = await aiohttp_client(gateway_app([ScriptedAdapter("stops", stopping)]))
    body = {"model": "stops", "max_tokens": 8, "messages": HI, "stream": True}
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01", "Idempotency-Key": "k-1"}

    async def events() -> list[bytes]:
        raw = await (await client.post("/v1/messages", json=body, headers=headers)).read()
        return [f[f.index(b"event: ") :] for f in raw.split(b"\n\n") if b"event: " in f]

    first = await events()
    assert first == await events()
    assert any(b'"stop_sequence":"\\n\\nHuman:"' in frame for frame in first)
    assert b'"input_tokens":11' in first[0]
