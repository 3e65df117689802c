"""The run endpoints through the real app over a scripted upstream: resume by event id, retrieve,
cancel, tenant isolation, the resume window, and how non-streaming requests end. Every test runs
on the in-process store and on a real Redis."""

from __future__ import annotations

import asyncio
import os

import pytest

from adapters.events import TextDelta
from gateway.app_keys import RUNS
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, add_tenant, chat_body, gateway_app, sse_events, stream_text
from tests.support.waiting import until

PIECES = [f"{i}:é " for i in range(40)]
OTHER_TENANT = {"Authorization": "Bearer sk-sluice-other-tenant"}
REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


async def make_client(aiohttp_client, store_settings, script=None, **settings):
    adapter = ScriptedAdapter("scripted", script or text_script(PIECES, delay=0.01))
    app = gateway_app(adapters=[adapter], **store_settings, **settings)
    add_tenant(app, "other", "sk-sluice-other-tenant")
    return adapter, await aiohttp_client(app)


async def start_stream(client, **body):
    resp = await client.post(
        "/v1/chat/completions", json=chat_body(stream=True, **body), headers=AUTH
    )
    assert resp.status == 200
    return resp


async def read_events(resp, count: int) -> list:
    """The first `count` events of a stream, then hang up."""
    raw = b""
    for _ in range(count):
        raw += await resp.content.readuntil(b"\n\n")
    resp.close()
    return sse_events(raw)


def payloads(events) -> list:
    return [e.json() for e in events if e.data != "[DONE]"]


async def resume(client, run_id: str, after: int | None = None, header: bool = False):
    params = {"stream": "true"}
    headers = dict(AUTH)
    if after is not None and header:
        headers["Last-Event-ID"] = str(after)
    elif after is not None:
        params["starting_after"] = str(after)
    return await client.get(f"/v1/chat/completions/{run_id}", params=params, headers=headers)


@pytest.mark.parametrize("header", [False, True])
async def test_a_dropped_stream_resumes_exactly_where_it_left(
    aiohttp_client, store_settings, header
):
    _, client = await make_client(aiohttp_client, store_settings)
    head = await read_events(await start_stream(client), 7)
    run_id = head[0].json()["id"]
    last = int(head[-1].id)
    resp = await resume(client, run_id, last, header=header)
    assert resp.status == 200
    rest = sse_events(await resp.read())
    assert rest[-1].data == "[DONE]"
    ids = [int(e.id) for e in head + rest[:-1]]
    assert ids == list(range(1, len(ids) + 1))  # none missing, none repeated
    assert stream_text(payloads(head) + payloads(rest)) == "".join(PIECES)


async def test_resume_from_zero_replays_everything_after_the_run_ended(
    aiohttp_client, store_settings
):
    _, client = await make_client(aiohttp_client, store_settings, text_script(PIECES[:5]))
    first = sse_events(await (await start_stream(client)).read())
    run_id = first[0].json()["id"]
    replay = sse_events(await (await resume(client, run_id)).read())
    assert [(e.id, e.data) for e in replay] == [(e.id, e.data) for e in first]
    metrics = await (await client.get("/metrics")).text()
    assert 'sluice_resumes_total{outcome="replayed"} 1.0' in metrics


async def test_retrieve_gives_status_then_the_final_object(aiohttp_client, store_settings):
    _, client = await make_client(aiohttp_client, store_settings)
    head = await read_events(await start_stream(client), 3)
    run_id = head[0].json()["id"]
    live = await (await client.get(f"/v1/chat/completions/{run_id}", headers=AUTH)).json()
    assert (live["id"], live["status"], live["object"]) == (
        run_id,
        "in_progress",
        "chat.completion",
    )
    await (await resume(client, run_id, 3)).read()
    done = await (await client.get(f"/v1/chat/completions/{run_id}", headers=AUTH)).json()
    assert done["status"] == "completed"
    assert done["choices"][0]["message"]["content"] == "".join(PIECES)
    assert done["choices"][0]["finish_reason"] == "stop"


async def test_another_tenants_run_is_a_404_like_an_unknown_one(aiohttp_client, store_settings):
    _, client = await make_client(aiohttp_client, store_settings, text_script(PIECES[:3]))
    run_id = sse_events(await (await start_stream(client)).read())[0].json()["id"]
    for path in (f"/v1/chat/completions/{run_id}", "/v1/chat/completions/chatcmpl-nope"):
        resp = await client.get(path, headers=OTHER_TENANT if "nope" not in path else AUTH)
        assert resp.status == 404
        assert (await resp.json())["error"]["code"] == "not_found"
    cancel = await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=OTHER_TENANT)
    assert cancel.status == 404
    resumed = await client.get(
        f"/v1/chat/completions/{run_id}", params={"stream": "true"}, headers=OTHER_TENANT
    )
    assert resumed.status == 404


async def test_cancel_ends_a_live_stream_and_is_idempotent(aiohttp_client, store_settings):
    adapter, client = await make_client(aiohttp_client, store_settings)
    resp = await start_stream(client)
    first = await resp.content.readuntil(b"\n\n")
    run_id = sse_events(first)[0].json()["id"]
    cancel = await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=AUTH)
    assert cancel.status == 200
    assert (await cancel.json())["status"] == "cancelled"
    rest = sse_events(await resp.read())
    assert rest[-2].json()["error"]["code"] == "cancelled"
    assert rest[-1].data == "[DONE]"
    again = await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=AUTH)
    assert (await again.json())["status"] == "cancelled"
    assert adapter.abort_calls == [run_id]


async def test_cancel_after_completion_answers_completed(aiohttp_client, store_settings):
    _, client = await make_client(aiohttp_client, store_settings, text_script(PIECES[:2]))
    run_id = sse_events(await (await start_stream(client)).read())[0].json()["id"]
    cancel = await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=AUTH)
    assert (await cancel.json())["status"] == "completed"


async def test_events_no_longer_kept_are_a_410(aiohttp_client, store_settings):
    _, client = await make_client(aiohttp_client, store_settings, run_max_events=8)
    run_id = sse_events(await (await start_stream(client)).read())[0].json()["id"]
    resp = await resume(client, run_id, 1)
    assert resp.status == 410
    assert resp.headers["x-should-retry"] == "false"
    assert (await resp.json())["error"]["code"] == "resume_window_expired"


@pytest.mark.parametrize("value", ["-1", "abc", "1.5"])
async def test_a_bad_resume_point_is_a_400_naming_it(aiohttp_client, store_settings, value):
    _, client = await make_client(aiohttp_client, store_settings, text_script(PIECES[:2]))
    run_id = sse_events(await (await start_stream(client)).read())[0].json()["id"]
    resp = await client.get(
        f"/v1/chat/completions/{run_id}",
        params={"stream": "true", "starting_after": value},
        headers=AUTH,
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["param"] == "starting_after"


async def test_a_resume_inside_the_grace_window_keeps_the_run(aiohttp_client, store_settings):
    adapter, client = await make_client(aiohttp_client, store_settings, disconnect_grace=5)
    head = await read_events(await start_stream(client), 4)
    run_id = head[0].json()["id"]
    await until(lambda: client.app[RUNS].in_grace(run_id), "the client's leaving to be noticed")
    rest = sse_events(await (await resume(client, run_id, int(head[-1].id))).read())
    assert stream_text(payloads(head) + payloads(rest)) == "".join(PIECES)
    assert adapter.aborted == {run_id: False}


def pausing_script(request) -> list:
    """Six pieces at once, then a long pause: when the grace window ends, nothing is in flight,
    so the cancel is clean (a piece already on its way would be a measured tail)."""
    return [TextDelta(p) for p in PIECES[:6]] + [60.0] + [TextDelta(p) for p in PIECES[6:]]


async def test_no_resume_within_the_grace_window_cancels_and_counts(aiohttp_client, store_settings):
    adapter, client = await make_client(
        aiohttp_client, store_settings, script=pausing_script, disconnect_grace=0.1
    )
    head = await read_events(await start_stream(client), 4)
    run_id = head[0].json()["id"]

    async def ended() -> dict | None:
        body = await (await client.get(f"/v1/chat/completions/{run_id}", headers=AUTH)).json()
        return body if body["status"] != "in_progress" else None

    body = await until(ended, "the run to end")
    assert body["status"] == "cancelled"
    assert body["error"]["code"] == "cancelled"
    choice = body["choices"][0]
    sent = choice["message"]["content"]  # what reached the log before the end
    assert sent.startswith("".join(PIECES[:3])) and "".join(PIECES).startswith(sent)
    assert choice["finish_reason"] is None  # it never finished
    assert body["usage"] is None  # the upstream never reported it

    async def counted() -> str | None:
        metrics = await (await client.get("/metrics")).text()
        return metrics if "sluice_cancellations_total{" in metrics else None

    metrics = await until(counted, "the cancel to be counted")
    assert 'sluice_cancellations_total{outcome="clean",source="disconnect"} 1.0' in metrics
    assert "sluice_disconnects_total 1.0" in metrics
    assert adapter.aborted == {run_id: True}


async def test_a_non_stream_request_cancelled_elsewhere_is_a_499(aiohttp_client, store_settings):
    _, client = await make_client(aiohttp_client, store_settings)
    waiting = asyncio.create_task(
        client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    )
    runs = client.app[RUNS]
    await until(lambda: runs.drivers, "the request's run to start")
    (run_id,) = list(runs.drivers)
    await client.post(f"/v1/chat/completions/{run_id}/cancel", headers=AUTH)
    resp = await waiting
    assert resp.status == 499
    assert resp.headers["x-should-retry"] == "false"
    assert (await resp.json())["error"]["code"] == "cancelled"


async def test_a_non_stream_request_past_its_deadline_is_a_504(aiohttp_client, store_settings):
    _, client = await make_client(
        aiohttp_client,
        store_settings,
        lambda r: [TextDelta("a"), 5.0, TextDelta("b")],
        inter_token_timeout=0.1,
    )
    resp = await client.post("/v1/chat/completions", json=chat_body(), headers=AUTH)
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == "timeout"
