"""The gateway app over an in-process scripted adapter: framing, errors and aborts."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from structlog.testing import capture_logs

from adapters.base import BackendFailed, BackendUnavailable
from adapters.events import ErrorEvent, Finish, TextDelta, Usage
from gateway.app_keys import HEALTH, RUNS
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, chat_body, gateway_app, stream_payloads, stream_text
from tests.support.waiting import until


async def make_client(aiohttp_client, script, model="scripted", **settings):
    adapter = ScriptedAdapter(model, script)
    return adapter, await aiohttp_client(gateway_app(adapters=[adapter], **settings))


async def post(client, **body):
    return await client.post("/v1/chat/completions", json=chat_body(**body), headers=AUTH)


async def test_n_choices_each_get_a_role_chunk_and_a_finish(aiohttp_client):
    def script(request):
        return [
            [TextDelta("a", 0), TextDelta("b", 1)],
            TextDelta("c", 0),
            Finish("stop", 0),
            Finish("length", 1),
            Usage(3, 3),
        ]

    _, client = await make_client(aiohttp_client, script)
    payloads = stream_payloads(await (await post(client, stream=True, n=2)).read())
    roles = [p["choices"][0]["index"] for p in payloads[:2]]
    assert roles == [0, 1]
    assert all(p["choices"][0]["delta"]["role"] == "assistant" for p in payloads[:2])
    assert (stream_text(payloads, 0), stream_text(payloads, 1)) == ("ac", "b")
    finishes = {
        c["index"]: c["finish_reason"]
        for p in payloads[:-1]
        for c in p["choices"]
        if c["finish_reason"]
    }
    assert finishes == {0: "stop", 1: "length"}


async def test_error_event_mid_stream_is_an_error_frame(aiohttp_client):
    def script(request):
        return [
            TextDelta("ok"),
            ErrorEvent("worker_error", "The model worker failed."),
            TextDelta("never sent"),
        ]

    _, client = await make_client(aiohttp_client, script)
    payloads = stream_payloads(await (await post(client, stream=True)).read())
    assert stream_text(payloads) == "ok"
    assert payloads[-2] == {
        "error": {
            "message": "The model worker failed.",
            "type": "server_error",
            "param": None,
            "code": "worker_error",
        }
    }
    assert payloads[-1] == "[DONE]"


async def test_error_event_without_stream_is_a_502(aiohttp_client):
    _, client = await make_client(
        aiohttp_client, lambda r: [TextDelta("x"), ErrorEvent("worker_error", "failed")]
    )
    resp = await post(client)
    assert resp.status == 502
    assert (await resp.json())["error"] == {
        "message": "failed",
        "type": "server_error",
        "param": None,
        "code": "worker_error",
    }


@pytest.mark.parametrize(
    ("exc", "status", "code"),
    [
        (BackendUnavailable("busy", 3), 503, "overloaded"),
        (BackendFailed("x"), 502, "upstream_error"),
    ],
)
async def test_backend_failure_before_first_event_is_an_http_error(
    aiohttp_client, exc, status, code
):
    _, client = await make_client(aiohttp_client, lambda r: [exc])
    for stream in (True, False):
        resp = await post(client, stream=stream)
        assert resp.status == status
        assert (await resp.json())["error"]["code"] == code
    if status == 503:
        assert resp.headers["retry-after"] == "3"


async def test_backend_failure_after_first_event_is_an_error_frame(aiohttp_client):
    _, client = await make_client(aiohttp_client, lambda r: [TextDelta("x"), BackendFailed()])
    payloads = stream_payloads(await (await post(client, stream=True)).read())
    assert payloads[-2]["error"]["code"] == "upstream_error"


async def test_disconnect_closes_the_adapter_stream(aiohttp_client):
    adapter, client = await make_client(
        aiohttp_client, text_script([f"t{i} " for i in range(100)], delay=0.02), disconnect_grace=0
    )
    resp = await post(client, stream=True)
    await resp.content.readuntil(b"t1 ")
    resp.close()

    async def noticed() -> str | None:
        metrics = await (await client.get("/metrics")).text()
        return metrics if adapter.aborted and "sluice_disconnects_total 1.0" in metrics else None

    metrics = await until(noticed, "the disconnect to reach the adapter")
    (request_id,) = adapter.aborted
    assert adapter.aborted[request_id] is True
    assert "sluice_disconnects_total 1.0" in metrics
    assert "sluice_active_streams 0.0" in metrics


async def test_non_stream_disconnect_closes_the_adapter_stream(aiohttp_client):
    adapter, client = await make_client(
        aiohttp_client, text_script([f"t{i} " for i in range(100)], delay=0.02), disconnect_grace=0
    )
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(post(client), 0.1)
    await until(lambda: adapter.aborted, "the disconnect to reach the adapter")
    (request_id,) = adapter.aborted
    assert adapter.aborted[request_id] is True


async def test_models_health_and_auth(aiohttp_client):
    _, client = await make_client(aiohttp_client, text_script(["x"]), model="m1")
    models = await (await client.get("/v1/models", headers=AUTH)).json()
    assert [m["id"] for m in models["data"]] == ["m1"]
    assert (await client.get("/v1/models/m1", headers=AUTH)).status == 200
    assert (await client.get("/v1/models/nope", headers=AUTH)).status == 404
    assert (await client.get("/v1/models")).status == 401
    assert (await client.get("/healthz")).status == 200
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert await ready.json() == {"status": "ready", "models": {"m1": True}, "store": "in-process"}


async def test_readyz_says_per_model_whether_a_backend_can_serve_it(aiohttp_client):
    up = ScriptedAdapter("m1", text_script(["x"]))
    down = ScriptedAdapter("m2", text_script(["y"]), ready=False)
    client = await aiohttp_client(gateway_app(adapters=[up, down]))
    ready = await client.get("/readyz")
    assert ready.status == 200  # some model can be served: the replica stays in
    assert await ready.json() == {
        "status": "degraded",
        "models": {"m1": True, "m2": False},
        "store": "in-process",
    }
    up.is_ready = False
    await client.app[HEALTH].probe()
    ready = await client.get("/readyz")
    assert ready.status == 503  # none can: out
    assert await ready.json() == {
        "status": "unavailable",
        "models": {"m1": False, "m2": False},
        "store": "in-process",
    }


def test_the_app_refuses_to_run_without_a_key():
    with pytest.raises(ValueError, match="no credentials configured"):
        gateway_app(adapters=[], api_key=[])


CANCELLED_RUN = 'sluice_runs_finished_total{model="scripted",reason="cancelled"} 1.0'


async def test_client_gone_before_the_first_token_is_counted_and_aborts(aiohttp_client):
    adapter, client = await make_client(
        aiohttp_client, lambda r: [5.0, TextDelta("late")], disconnect_grace=0
    )
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(post(client, stream=True), 0.2)

    async def counted() -> str | None:
        metrics = await (await client.get("/metrics")).text()
        # NOTE: the disconnect is counted when the stream's task is cancelled; the run settles
        # (its cancel confirmed by the upstream) after it
        done = "sluice_disconnects_total 1.0" in metrics and CANCELLED_RUN in metrics
        return metrics if done else None

    metrics = await until(counted, "the disconnect to be counted and the run settled")
    assert list(adapter.aborted.values()) == [True]
    assert 'sluice_cancellations_total{outcome="clean",source="disconnect"} 1.0' in metrics


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_not_in_its_content_encoding_is_a_400_that_closes(aiohttp_client, encoding):
    _, client = await make_client(aiohttp_client, text_script(["x"]))
    with capture_logs() as logs:
        resp = await client.post(
            "/v1/chat/completions",
            data=b'{"model": "scripted", "secret-4b1d": 1}',
            headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": encoding},
        )
        raw = await resp.read()
    assert resp.status == 400
    assert resp.headers["Connection"] == "close"
    assert orjson.loads(raw) == {
        "error": {
            "message": "The request body could not be decoded: it is not valid for its "
            "Content-Encoding.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_body",
        }
    }
    assert not [e for e in logs if e["log_level"] == "error"]


async def test_a_long_content_type_or_model_is_repeated_cut_short(aiohttp_client):
    _, client = await make_client(aiohttp_client, text_script(["x"]))
    resp = await client.post(
        "/v1/chat/completions",
        data=b"{}",
        headers={**AUTH, "Content-Type": "text/" + "x" * 5000},
    )
    assert resp.status == 415
    assert (await resp.json())["error"]["message"] == (
        "Unsupported Content-Type 'text/" + "x" * 35 + "…'; send the body as 'application/json'."
    )
    resp = await post(client, model="m" * 100_000)
    assert resp.status == 404
    assert (await resp.json())["error"]["message"] == (
        "The model '" + "m" * 40 + "…' does not exist or you do not have access to it."
    )


async def test_a_run_is_driven_by_the_task_that_opened_it(aiohttp_client):
    """The run opens in a task of its own (a client gone meanwhile strands nothing) and that
    task goes on to drive it: its first step upstream waits for no second task's first turn."""
    tasks = {}

    def script(request):
        tasks["streamed"] = asyncio.current_task()
        return [TextDelta("hi"), Finish("stop"), Usage(3, 1)]

    _, client = await make_client(aiohttp_client, script)
    runs = client.app[RUNS]
    start = runs.start

    async def recorded_start(spec, *args, **kwargs):
        tasks["opened"] = asyncio.current_task()
        return await start(spec, *args, **kwargs)

    runs.start = recorded_start
    resp = await post(client, stream=True)
    assert stream_text(stream_payloads(await resp.read())) == "hi"
    run_id = resp.headers["x-sluice-run-id"]
    assert tasks["streamed"] is tasks["opened"]
    assert tasks["streamed"].get_name() == f"run {run_id}"
