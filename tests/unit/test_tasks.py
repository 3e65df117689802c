"""Background tasks stop at shutdown in bounded time, even one that swallows a cancel."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from gateway.tasks import stop_tasks


def swallowing(budget: list[int], swallowed: list[int]) -> asyncio.Task:
    """A loop that, like a library read under its own timeout, takes a cancel for a timeout
    while `budget[0]` says it still may."""

    async def loop() -> None:
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                if len(swallowed) >= budget[0]:
                    raise
                swallowed.append(1)
                asyncio.current_task().uncancel()

    return asyncio.create_task(loop(), name=f"swallows {budget[0]}")


async def test_a_plain_task_ends_with_one_cancel():
    swallowed: list[int] = []
    task = swallowing([0], swallowed)
    await asyncio.sleep(0)  # NOTE: let it start and wait
    await stop_tasks([task, None], within=5)
    assert task.cancelled()
    assert swallowed == []


async def test_a_swallowed_cancel_is_repeated():
    swallowed: list[int] = []
    task = swallowing([1], swallowed)
    await asyncio.sleep(0)  # NOTE: let it start and wait
    await stop_tasks([task], within=0.05)
    assert task.cancelled()
    assert swallowed == [1]


async def test_a_task_that_will_not_stop_is_left_and_named():
    swallowed: list[int] = []
    budget = [99]
    task = swallowing(budget, swallowed)
    await asyncio.sleep(0)  # NOTE: let it start and wait
    with capture_logs() as logs:
        await asyncio.wait_for(stop_tasks([task], within=0.05), 5)
    assert not task.done()
    assert swallowed == [1, 1]
    assert logs[-1]["event"] == "background tasks did not stop; left behind"
    assert logs[-1]["tasks"] == ["swallows 99"]
    budget[0] = 0  # it lets go: the next cancel ends it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_error_at_shutdown_is_retrieved_not_raised():
    async def fails() -> None:
        raise RuntimeError("boom")

    task = asyncio.create_task(fails())
    await asyncio.wait([task])
    await stop_tasks([task])
    assert isinstance(task.exception(), RuntimeError)
