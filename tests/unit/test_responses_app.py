"""The Responses API through the real app on a scripted upstream: typed events numbered 0..K,
resume after any number, the object, background runs, cancel, delete, input items, and 400s
that name the Responses field."""

from __future__ import annotations

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from adapters.events import Finish, ToolCallDelta, Usage
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, gateway_app, sse_events
from tests.support.waiting import until

PIECES = ["Hel", "lo", " wör", "ld", "!"]
STREAM_EVENT = TypeAdapter(ResponseStreamEvent)  # the SDK's own types, validated strictly


def body(**extra) -> dict:
    return {"model": "scripted", "input": "Hi"} | extra


def events_of(raw: bytes) -> list[dict]:
    return [orjson.loads(e.data) for e in sse_events(raw) if e.data != "[DONE]"]


async def make_client(aiohttp_client, store_settings, script=None, **settings):
    """The app on a scripted upstream, with the in-process store or a real Redis."""
    adapter = ScriptedAdapter("scripted", script or text_script(PIECES))
    app = gateway_app(adapters=[adapter], **store_settings, **settings)
    client = await aiohttp_client(app)
    return client, adapter


async def test_a_stream_is_typed_events_numbered_from_zero_without_gaps(
    aiohttp_client, store_settings
):
    client, _ = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/responses", json=body(stream=True), headers=AUTH)
    assert resp.status == 200
    events = events_of(await resp.read())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == PIECES
    for event in events:
        STREAM_EVENT.validate_python(event)
    final = Response.model_validate(events[-1]["response"])
    assert final.status == "completed"
    assert final.output_text == "".join(PIECES)
    assert final.usage.output_tokens == len(PIECES)


async def test_resume_after_any_number_gives_exactly_the_rest(aiohttp_client, store_settings):
    client, _ = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/responses", json=body(stream=True), headers=AUTH)
    events = events_of(await resp.read())
    rid = events[0]["response"]["id"]
    for after in (0, 3, len(events) - 2):
        again = await client.get(
            f"/v1/responses/{rid}", params={"stream": "true", "starting_after": after}, headers=AUTH
        )
        assert events_of(await again.read()) == events[after + 1 :]


async def test_the_object_agrees_with_the_stream_and_lists_its_input(
    aiohttp_client, store_settings
):
    client, _ = await make_client(aiohttp_client, store_settings)
    resp = await client.post(
        "/v1/responses",
        json=body(input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]),
        headers=AUTH,
    )
    assert resp.status == 200
    created = await resp.json()
    assert created["status"] == "completed" and created["id"].startswith("resp_")
    got = await (await client.get(f"/v1/responses/{created['id']}", headers=AUTH)).json()
    assert got == created
    items = await (
        await client.get(f"/v1/responses/{created['id']}/input_items", headers=AUTH)
    ).json()
    assert [i["content"][0]["text"] for i in items["data"]] == ["Hi"]
    assert items["has_more"] is False


async def test_background_runs_on_with_nobody_attached_and_cancels_explicitly(
    aiohttp_client, store_settings
):
    client, adapter = await make_client(
        aiohttp_client, store_settings, text_script(PIECES * 50, delay=0.05), disconnect_grace=0.0
    )
    resp = await client.post("/v1/responses", json=body(background=True), headers=AUTH)
    created = await resp.json()
    assert created["status"] in ("queued", "in_progress") and created["background"] is True
    rid = created["id"]
    # text keeps coming long after a grace of 0 s with nobody attached
    await until(lambda: text_of(client, rid), "some text with no client attached")
    first = await text_of(client, rid)
    await until(lambda: longer_than(client, rid, first), "more text, still unattached")
    cancelled = await (await client.post(f"/v1/responses/{rid}/cancel", headers=AUTH)).json()
    assert cancelled["status"] == "cancelled"
    assert rid in adapter.abort_calls  # the upstream was told to stop
    assert len(await text_of(client, rid)) < len("".join(PIECES * 50))


async def longer_than(client, rid: str, text: str) -> bool:
    return len(await text_of(client, rid)) > len(text)


async def text_of(client, rid: str) -> str:
    got = await (await client.get(f"/v1/responses/{rid}", headers=AUTH)).json()
    return "".join(
        p["text"] for item in got["output"] if item["type"] == "message" for p in item["content"]
    )


async def test_the_follow_token_alone_reads_and_resumes_the_response(
    aiohttp_client, store_settings
):
    client, _ = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/responses", json=body(stream=True), headers=AUTH)
    token = resp.headers["x-follow-token"]
    events = events_of(await resp.read())
    rid = events[0]["response"]["id"]
    got = await client.get(f"/v1/responses/{rid}", params={"token": token})
    assert (await got.json())["follow_token"] == token
    again = await client.get(
        f"/v1/responses/{rid}", params={"token": token, "stream": "true", "starting_after": 2}
    )
    assert events_of(await again.read()) == events[3:]
    last = events[-1]["sequence_number"]
    end = await client.get(
        f"/v1/responses/{rid}", params={"token": token, "stream": "true", "starting_after": last}
    )
    assert end.status == 204  # an EventSource stops here
    cancel = await client.post(f"/v1/responses/{rid}/cancel", params={"token": token})
    assert cancel.status == 401  # a token reads; it cancels nothing


async def test_a_stream_cancelled_mid_run_ends_with_response_cancelled(
    aiohttp_client, store_settings
):
    client, adapter = await make_client(
        aiohttp_client, store_settings, text_script(PIECES * 50, delay=0.02)
    )
    resp = await client.post("/v1/responses", json=body(stream=True), headers=AUTH)
    raw = b""
    while b"response.output_text.delta" not in raw:
        raw += await resp.content.readany()
    rid = events_of(raw.rsplit(b"\n\n", 1)[0] + b"\n\n")[0]["response"]["id"]
    assert (await client.post(f"/v1/responses/{rid}/cancel", headers=AUTH)).status == 200
    events = events_of(raw + await resp.read())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    last = events[-1]
    assert last["type"] == "response.cancelled"
    assert last["response"]["status"] == "cancelled"
    (message,) = last["response"]["output"]
    assert message["status"] == "incomplete"
    assert rid in adapter.abort_calls


async def test_a_repeat_with_its_idempotency_key_gets_the_same_response(
    aiohttp_client, store_settings
):
    client, adapter = await make_client(aiohttp_client, store_settings)
    headers = {**AUTH, "Idempotency-Key": "order-66"}
    first = await client.post("/v1/responses", json=body(stream=True), headers=headers)
    events = events_of(await first.read())
    again = await client.post("/v1/responses", json=body(stream=True), headers=headers)
    assert again.headers["idempotent-replayed"] == "true"
    assert events_of(await again.read()) == events
    assert len(adapter.requests) == 1  # one run
    other = await client.post("/v1/responses", json=body(input="Bye"), headers=headers)
    assert other.status == 422


async def test_a_deleted_response_is_gone(aiohttp_client, store_settings):
    client, _ = await make_client(aiohttp_client, store_settings)
    created = await (await client.post("/v1/responses", json=body(), headers=AUTH)).json()
    rid = created["id"]
    deleted = await client.delete(f"/v1/responses/{rid}", headers=AUTH)
    assert await deleted.json() == {"id": rid, "object": "response", "deleted": True}
    assert (await client.get(f"/v1/responses/{rid}", headers=AUTH)).status == 404
    assert (await client.delete(f"/v1/responses/{rid}", headers=AUTH)).status == 404


async def test_tool_calls_are_function_call_items(aiohttp_client, store_settings):
    def script(request):
        return [
            ToolCallDelta(0, '{"city": "Paris"}', "call_1", "weather"),
            Finish("tool_calls"),
            Usage(5, 3),
        ]

    client, _ = await make_client(aiohttp_client, store_settings, script)
    tool = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
    resp = await client.post("/v1/responses", json=body(stream=True, tools=[tool]), headers=AUTH)
    events = events_of(await resp.read())
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.done" in kinds
    (call,) = events[-1]["response"]["output"]
    assert call["type"] == "function_call" and call["name"] == "weather"
    assert call["call_id"] == "call_1" and call["arguments"] == '{"city": "Paris"}'


async def test_an_unknown_previous_response_is_a_404_naming_it(aiohttp_client, store_settings):
    client, adapter = await make_client(aiohttp_client, store_settings)
    resp = await client.post(
        "/v1/responses", json=body(previous_response_id="resp_no"), headers=AUTH
    )
    assert resp.status == 404
    assert (await resp.json())["error"]["param"] == "previous_response_id"
    assert adapter.requests == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"input": 3}, "input"),
        ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].type",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 9}, "temperature"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"background": True, "store": False}, "background"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(aiohttp_client, store_settings, extra, param):
    client, adapter = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/responses", json=body(**extra), headers=AUTH)
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == param
    assert adapter.requests == []


async def test_the_service_tier_is_checked_and_echoed_by_the_response(
    aiohttp_client, store_settings
):
    client, adapter = await make_client(aiohttp_client, store_settings)
    resp = await client.post("/v1/responses", json=body(service_tier="flex"), headers=AUTH)
    created = await resp.json()
    assert created["service_tier"] == "flex"
    assert Response.model_validate(created).service_tier == "flex"
    assert adapter.requests[-1].share.tier == "flex"
    refused = await client.post("/v1/responses", json=body(service_tier="priority"), headers=AUTH)
    error = (await refused.json())["error"]
    assert (refused.status, error["param"]) == (400, "service_tier")
