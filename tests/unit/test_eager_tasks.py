"""`start_eagerly` (gateway/eager_tasks.py): the coroutine's first step runs before the call
returns, as the new task, and the task takes it on from there, cancels and errors included."""

from __future__ import annotations

import asyncio
import contextvars

import pytest
from aiohttp import ClientRequest, web

from gateway.eager_tasks import eager_task_factory, start_eagerly, start_request_writes_eagerly

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


async def test_the_first_step_runs_now_as_the_new_task_and_the_task_runs_the_rest():
    steps: list[tuple[str, asyncio.Task | None]] = []
    go = asyncio.get_running_loop().create_future()

    async def work() -> str:
        steps.append(("first", asyncio.current_task()))
        value = await go
        steps.append(("rest", asyncio.current_task()))
        return value

    outer = asyncio.current_task()
    task = start_eagerly(work(), name="eager one")
    assert [s for s, _ in steps] == ["first"]  # before the call returned
    assert steps[0][1] is task and task.get_name() == "eager one"
    assert asyncio.current_task() is outer  # the caller's task is current again
    go.set_result("done")
    assert await task == "done"
    assert steps[1] == ("rest", task)


async def test_the_task_has_its_own_copy_of_the_callers_context():
    VAR.set("caller")
    seen: list[str] = []

    async def work() -> None:
        seen.append(VAR.get())
        VAR.set("task")
        await asyncio.sleep(0)
        seen.append(VAR.get())

    task = start_eagerly(work())
    assert seen == ["caller"]
    assert VAR.get() == "caller"  # what the first step set stayed in the task's context
    await task
    assert seen == ["caller", "task"]


async def test_a_coroutine_done_in_its_first_step_gives_its_result_or_its_error():
    async def straight() -> int:
        return 7

    async def fails() -> None:
        raise ValueError("bad")

    assert await start_eagerly(straight()) == 7
    failing = start_eagerly(fails())  # the error is the task's, not the caller's
    with pytest.raises(ValueError, match="bad"):
        await failing


async def test_a_cancel_before_the_tasks_first_turn_reaches_the_coroutine():
    seen: list[str] = []
    never = asyncio.get_running_loop().create_future()

    async def work() -> None:
        try:
            await never
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("cleaned up")

    task = start_eagerly(work())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled", "cleaned up"] and task.cancelled()


async def test_a_coroutine_that_takes_the_early_cancel_goes_on_in_its_task():
    resumed = asyncio.get_running_loop().create_future()

    async def work() -> str:
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            asyncio.current_task().uncancel()
        return await resumed  # it waits again, on something else, and the task follows

    task = start_eagerly(work())
    task.cancel()
    await asyncio.sleep(0)
    assert not task.done()
    resumed.set_result("went on")
    assert await task == "went on"


async def test_a_later_cancel_lands_where_the_coroutine_waits():
    seen: list[str] = []
    started = asyncio.Event()

    async def work() -> None:
        await asyncio.sleep(0)
        started.set()
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    task = start_eagerly(work())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled"]


async def test_outside_any_task_it_is_a_plain_task():
    loop = asyncio.get_running_loop()
    made: asyncio.Future[asyncio.Task] = loop.create_future()
    ran: list[str] = []

    async def work() -> str:
        ran.append("ran")
        return "ok"

    loop.call_soon(lambda: made.set_result(start_eagerly(work())))
    task = await made
    assert await task == "ok" and ran == ["ran"]


async def test_the_factory_starts_only_the_coroutines_it_picks_eagerly():
    order: list[str] = []

    async def picked() -> None:
        order.append("picked")

    async def other() -> None:
        order.append("other")

    async def picked_var() -> str:
        return VAR.get()

    picks = {picked.__code__, picked_var.__code__}
    loop = asyncio.get_running_loop()
    loop.set_task_factory(eager_task_factory(lambda coro: coro.cr_code in picks))
    try:
        tasks = [asyncio.create_task(other(), name="other"), asyncio.create_task(picked())]
        assert order == ["picked"] and tasks[0].get_name() == "other"
        await asyncio.gather(*tasks)
        assert order == ["picked", "other"]
        VAR.set("caller")
        fresh = asyncio.create_task(picked_var(), context=contextvars.Context())
        assert await fresh == "unset"  # the context it was given, even an empty one
    finally:
        loop.set_task_factory(None)


async def test_an_upstream_request_body_leaves_in_the_senders_turn(aiohttp_client, monkeypatch):
    """aiohttp's client writes a request's body in a task of its own (3.11: a plain task, a
    turn of the loop later); with the gateway's factory it is written before anything the loop
    had scheduled runs."""

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/", answer)
    client = await aiohttp_client(app)
    order: list[str] = []
    real = ClientRequest.write_bytes

    async def write_bytes(self, *args, **kwargs):
        order.append("body written")
        return await real(self, *args, **kwargs)

    monkeypatch.setattr(ClientRequest, "write_bytes", write_bytes)
    loop = asyncio.get_running_loop()
    start_request_writes_eagerly(loop)
    try:
        await (await client.post("/", data=b"warm")).read()  # a kept-alive connection first
        order.clear()
        loop.call_soon(order.append, "the loop's next callback")
        resp = await client.post("/", data=b"{}")
        assert await resp.text() == "ok"
    finally:
        loop.set_task_factory(None)
    assert order[0] == "body written"  # on 3.12 and later aiohttp itself starts it eagerly
