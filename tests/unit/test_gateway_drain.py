"""Graceful shutdown through the real app over a scripted upstream: while draining, `/readyz`
and new runs answer 503 and existing runs stay reachable; a live run that finishes in time
completes, one that does not is cancelled (source `shutdown`) and its stream still ends with
`[DONE]`. Every test runs on the in-process store and on a real Redis."""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp.test_utils import TestServer

from adapters.events import TextDelta
from gateway.app_keys import DRAIN, LEDGER, OPEN_STREAMS, RUNS
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, chat_body, gateway_app, sse_events, stream_text
from tests.support.waiting import until

PIECES = [f"{i}:é " for i in range(40)]
SHUTTING_DOWN = {
    "error": {
        "message": "The gateway is shutting down; retry on another replica.",
        "type": "server_error",
        "param": None,
        "code": "overloaded",
    }
}


def pausing_script(request) -> list:
    """Six pieces at once, then a long pause: the run is live, and nothing is in flight when it
    is cancelled (so the cancel is clean)."""
    return [TextDelta(p) for p in PIECES[:6]] + [60.0] + [TextDelta(p) for p in PIECES[6:]]


async def make_client(aiohttp_client, store_settings, script, tmp_path, **settings):
    adapter = ScriptedAdapter("scripted", script)
    usage = str(tmp_path / "usage.jsonl")
    app = gateway_app(adapters=[adapter], usage_file=usage, **store_settings, **settings)
    return adapter, await aiohttp_client(app)


async def start_stream(client) -> tuple[aiohttp.ClientResponse, str]:
    """A stream that has begun, and its run id."""
    resp = await client.post("/v1/chat/completions", json=chat_body(stream=True), headers=AUTH)
    assert resp.status == 200
    first = await resp.content.readuntil(b"\n\n")
    return resp, sse_events(first)[0].json()["id"]


def drain(client, within: float | None = None) -> asyncio.Task:
    """What `sluice serve` does on SIGTERM, while the app still serves."""
    app = client.app
    return asyncio.create_task(app[DRAIN].run(app[RUNS], app[OPEN_STREAMS], within))


async def metrics_with(client, sample: str) -> str | None:
    metrics = await (await client.get("/metrics")).text()
    return metrics if sample in metrics else None


async def test_draining_refuses_new_runs_and_keeps_existing_ones_reachable(
    aiohttp_client, store_settings, tmp_path
):
    adapter, client = await make_client(aiohttp_client, store_settings, pausing_script, tmp_path)
    resp, run_id = await start_stream(client)
    draining = drain(client)
    await until(lambda: client.app[DRAIN].draining, "the drain to begin")

    ready = await client.get("/readyz")
    assert ready.status == 503
    assert (await ready.json())["status"] == "draining"
    refused = await client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    assert refused.status == 503
    assert refused.headers["retry-after"] == "1"
    assert await refused.json() == SHUTTING_DOWN
    assert len(adapter.requests) == 1  # the refused one never reached the upstream

    live = await client.get(f"/v1/chat/completions/{run_id}", headers=AUTH)
    assert (await live.json())["status"] == "in_progress"
    resumed = await client.get(
        f"/v1/chat/completions/{run_id}", params={"stream": "true"}, headers=AUTH
    )
    assert resumed.status == 200
    cancel = await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=AUTH)
    assert (await cancel.json())["status"] == "cancelled"
    for stream in (resp, resumed):  # both followers get the end of the run
        events = sse_events(await stream.read())
        assert events[-2].json()["error"]["code"] == "cancelled"
        assert events[-1].data == "[DONE]"
    await asyncio.wait_for(draining, 5)  # no run left: the drain is over
    assert client.app[RUNS].drivers == {}


async def test_a_run_that_finishes_within_the_timeout_completes(
    aiohttp_client, store_settings, tmp_path
):
    script = text_script(PIECES, delay=0.01)
    adapter, client = await make_client(
        aiohttp_client, store_settings, script, tmp_path, shutdown_timeout=30
    )
    resp, run_id = await start_stream(client)
    draining = drain(client)
    events = sse_events(await resp.read())
    await asyncio.wait_for(draining, 5)  # over when the run is, not after the 30 s
    payloads = [e.json() for e in events[:-1]]
    assert events[-1].data == "[DONE]"
    assert stream_text(payloads) == "".join(PIECES)
    assert payloads[-1]["choices"][0]["finish_reason"] == "stop"
    assert adapter.aborted == {run_id: False}


async def test_a_run_still_live_at_the_timeout_is_cancelled_for_shutdown(
    aiohttp_client, store_settings, tmp_path
):
    adapter, client = await make_client(
        aiohttp_client, store_settings, pausing_script, tmp_path, shutdown_timeout=0.1
    )
    resp, run_id = await start_stream(client)
    await until(lambda: adapter.sleeping(run_id), "the upstream's pause")
    draining = drain(client)
    events = sse_events(await resp.read())
    await asyncio.wait_for(draining, 5)

    assert events[-1].data == "[DONE]"
    error = events[-2].json()["error"]
    assert error["code"] == "cancelled"
    assert "shutting down" in error["message"]
    assert adapter.aborted == {run_id: True}
    record = await client.app[RUNS].get(run_id)
    assert (record.terminal.status.name, record.terminal.cause) == ("CANCELLED", "cancel:shutdown")
    sample = 'sluice_cancellations_total{outcome="clean",source="shutdown"} 1.0'
    assert await until(lambda: metrics_with(client, sample), "the cancel to be counted")
    (usage,) = [r async for r in client.app[LEDGER].read()]  # settled like any cancel
    assert (usage.status, usage.cancel_source) == ("cancelled", "shutdown")


async def test_a_second_signal_cancels_the_live_runs_at_once(
    aiohttp_client, store_settings, tmp_path
):
    adapter, client = await make_client(
        aiohttp_client, store_settings, pausing_script, tmp_path, shutdown_timeout=30
    )
    resp, run_id = await start_stream(client)
    draining = drain(client)
    await until(lambda: client.app[DRAIN].draining, "the drain to begin")
    client.app[DRAIN].hurry()
    await asyncio.wait_for(draining, 5)
    events = sse_events(await resp.read())
    assert events[-2].json()["error"]["code"] == "cancelled"
    assert events[-1].data == "[DONE]"
    assert (await client.app[RUNS].get(run_id)).terminal.cause == "cancel:shutdown"
    assert adapter.aborted == {run_id: True}


async def test_with_no_live_run_the_drain_ends_at_once(aiohttp_client, store_settings, tmp_path):
    _, client = await make_client(
        aiohttp_client, store_settings, text_script(PIECES[:3]), tmp_path, shutdown_timeout=30
    )
    done = await client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    assert done.status == 200
    await asyncio.wait_for(drain(client), 1)
    assert (await client.get("/readyz")).status == 503


async def test_an_app_shut_down_without_a_drain_still_ends_its_streams(store_settings, tmp_path):
    """aiohttp's own shutdown (no SIGTERM drain first): the live run is cancelled at once, and
    its stream gets the ending and [DONE] before the connection closes."""
    adapter = ScriptedAdapter("scripted", pausing_script)
    usage = str(tmp_path / "usage.jsonl")
    server = TestServer(gateway_app(adapters=[adapter], usage_file=usage, **store_settings))
    await server.start_server()
    async with aiohttp.ClientSession() as session:
        url = server.make_url("/v1/chat/completions")
        resp = await session.post(url, json=chat_body(stream=True), headers=AUTH)
        run_id = sse_events(await resp.content.readuntil(b"\n\n"))[0].json()["id"]
        await until(lambda: adapter.sleeping(run_id), "the upstream's pause")
        closing = asyncio.create_task(server.close())
        events = sse_events(await resp.read())
        await asyncio.wait_for(closing, 10)
    assert events[-2].json()["error"]["code"] == "cancelled"
    assert events[-1].data == "[DONE]"
    assert adapter.aborted == {run_id: True}
