"""A stream that waits for its run's first events is opened by the run's driver as it appends
them (gateway/runs/follow.py `_Delivery`): its headers and first frames leave in the driver's
step, not a turn of the loop later in the stream's own task; the stream's task, woken all the
same, sends only what came after. Where preparing the response would wait (a prepare hook that
suspends), the stream's own task opens it as before. Either way the client reads every event
once, in order."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from gateway.app_keys import RUNS
from gateway.http.sse import SSEWriter, completes_now
from gateway.protocol import parse_chat_request
from gateway.runs.life import RunLife
from gateway.runs.status import RunStatus
from testkit.scripted_adapter import ScriptedAdapter, text_script
from tests.support.gateway import AUTH, chat_body, gateway_app, sse_events, stream_text
from tests.support.waiting import until

PIECES = [f"{i} " for i in range(12)]


class HeldAdapter(ScriptedAdapter):
    """Streams nothing until `go` is set: the test decides when the first events come."""

    def __init__(self) -> None:
        super().__init__("scripted", text_script(PIECES))
        self.go = asyncio.Event()

    async def stream(self, request, request_id):
        await self.go.wait()
        async for batch in super().stream(request, request_id):
            yield batch


def record_open_now(monkeypatch) -> list[tuple[str, bool]]:
    """(the task it ran in, whether it opened the stream) of each `SSEWriter.open_now`."""
    calls: list[tuple[str, bool]] = []
    real = SSEWriter.open_now.__func__

    def open_now(cls, *args, **kwargs):
        writer = real(cls, *args, **kwargs)
        calls.append((asyncio.current_task().get_name(), writer is not None))
        return writer

    monkeypatch.setattr(SSEWriter, "open_now", classmethod(open_now))
    return calls


async def stream_once_waiting(aiohttp_client, app, adapter) -> tuple[str, list]:
    """Start a stream, let the upstream answer once its stream waits for the first events;
    (the run's id, every event the client read)."""
    client = await aiohttp_client(app)
    body = chat_body(stream=True, stream_options={"include_usage": True})
    answer = asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=AUTH))
    runs = app[RUNS]

    def waiting_run() -> str | None:  # counted in, it goes on to wait with no suspension
        return next((r for r in runs.drivers if runs.store.followers_now(r) == 1), None)

    run_id = await until(waiting_run, "the stream to wait for its run's first events")
    adapter.go.set()
    resp = await answer
    assert resp.status == 200
    return run_id, sse_events(await resp.read())


def check_whole(events: list) -> None:
    """Every event once, in order, the text whole, then [DONE]."""
    assert events[-1].data == "[DONE]"
    ids = [int(e.id) for e in events[:-1]]
    assert ids == list(range(1, len(ids) + 1))
    assert stream_text([e.json() for e in events[:-1]]) == "".join(PIECES)


async def test_the_driver_opens_a_waiting_stream_with_its_first_events(aiohttp_client, monkeypatch):
    calls = record_open_now(monkeypatch)
    adapter = HeldAdapter()
    run_id, events = await stream_once_waiting(aiohttp_client, gateway_app([adapter]), adapter)
    assert calls == [(f"run {run_id}", True)]  # in the driver's task, and it opened the stream
    # NOTE: the upstream's batches came with no suspension between them, so the stream's task
    # read the first events again along with later ones: none of them may come twice
    check_whole(events)


async def test_a_prepare_that_would_wait_leaves_the_opening_to_the_stream(
    aiohttp_client, monkeypatch
):
    async def suspends(request: web.Request, response: web.StreamResponse) -> None:
        await asyncio.sleep(0)
        response.headers["x-prepared-by"] = "hook"

    calls = record_open_now(monkeypatch)
    adapter = HeldAdapter()
    app = gateway_app([adapter])
    app.on_response_prepare.append(suspends)
    run_id, events = await stream_once_waiting(aiohttp_client, app, adapter)
    assert calls == [(f"run {run_id}", False)]  # nothing sent: the stream opened it itself
    check_whole(events)


async def test_completes_now_runs_a_step_to_its_end_or_cancels_it_where_it_waits():
    done: list[str] = []

    async def straight() -> None:
        done.append("straight")

    async def waits() -> None:
        try:
            await asyncio.sleep(0)
            done.append("woke")
        except asyncio.CancelledError:
            done.append("cancelled")
            raise

    assert completes_now(straight())
    assert not completes_now(waits())
    assert done == ["straight", "cancelled"]


async def test_a_request_cancelled_while_its_run_opens_leaves_that_run_cancelled(
    aiohttp_client, monkeypatch
):
    """The answer awaits the opening unshielded: the request's cancel cancels what it awaits,
    and the opening task, once the run is open, cancels the run nobody will read."""
    entered, release = asyncio.Event(), asyncio.Event()
    real = RunLife._open_run

    async def held(self):
        entered.set()
        await release.wait()
        return await real(self)

    monkeypatch.setattr(RunLife, "_open_run", held)
    opened: list[str] = []

    async def open_then_go(request: web.Request) -> web.Response:
        body = await request.json()
        life = RunLife(request, parse_chat_request(body), body)
        opening = asyncio.create_task(life.open())
        await entered.wait()
        opening.cancel()
        with pytest.raises(asyncio.CancelledError):
            await opening
        release.set()
        opened.append(life.spec.run_id)
        return web.json_response({})

    app = gateway_app([ScriptedAdapter("scripted", text_script(PIECES, delay=0.05))])
    app.router.add_post("/v1/test/open", open_then_go)
    client = await aiohttp_client(app)
    resp = await client.post("/v1/test/open", json=chat_body(), headers=AUTH)
    assert resp.status == 200
    runs = app[RUNS]

    async def ended():
        record = await runs.get(opened[0])
        return record.terminal if record.status.is_terminal and not runs.drivers else None

    terminal = await until(ended, "the abandoned run to end and settle")
    assert terminal.status is RunStatus.CANCELLED and terminal.cause == "cancel:disconnect"


async def test_a_runs_way_upstream_runs_in_its_requests_own_turn(aiohttp_client):
    """The run's opening task starts eagerly (gateway/eager_tasks.py): its upstream request
    begins before anything the loop had scheduled runs, not a turn of the loop later."""
    order: list[str] = []

    class Entered(ScriptedAdapter):
        async def stream(self, request, request_id):
            order.append(f"upstream in {asyncio.current_task().get_name()}")
            async for batch in super().stream(request, request_id):
                yield batch

    async def open_run(request: web.Request) -> web.Response:
        body = await request.json()
        life = RunLife(request, parse_chat_request(body), body)
        asyncio.get_running_loop().call_soon(order.append, "the loop's next callback")
        opened = await life.open()
        order.append("opened")
        return web.json_response({"run_id": opened.run_id})

    app = gateway_app([Entered("scripted", text_script(PIECES))])
    app.router.add_post("/v1/test/open", open_run)
    client = await aiohttp_client(app)
    resp = await client.post("/v1/test/open", json=chat_body(), headers=AUTH)
    run_id = (await resp.json())["run_id"]
    assert order[:2] == [f"upstream in run {run_id}", "opened"]
    await until(lambda: not app[RUNS].drivers, "the run to end")
