"""Stopping the gateway's background tasks at shutdown, in bounded time; and finishing work that
a shutdown's first cancel must not cut in half.

A cancel can be lost inside a library: redis-py swallows one that lands just as one of its own
read timeouts fires (redis-py #2551), and the task then runs on as if nothing happened. A
shutdown that awaits such a task waits for ever. So each task is cancelled, waited for, and
cancelled once more if it is still running; one that survives both is logged by name and left
behind rather than holding the process.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

import structlog

log = structlog.get_logger("sluice.tasks")

STOP_WITHIN = 2.0  # seconds each cancel is given
T = TypeVar("T")


async def finish_then_reraise(work: Awaitable[T], cancelled: asyncio.CancelledError | None) -> T:
    """`work` to its end, shielded, then `cancelled` (a cancel that came before) or one that
    comes meanwhile raised again. NOTE: only a second cancel (`stop_tasks`) stops the wait, and
    even then `work` goes on to its end apart from the caller."""
    running = asyncio.ensure_future(work)
    try:
        result = await asyncio.shield(running)
    except asyncio.CancelledError as exc:  # the caller is cancelled as the work finishes
        if cancelled is not None:
            raise
        cancelled = exc
        await asyncio.shield(running)
    if cancelled is not None:
        raise cancelled
    return result


async def stop_tasks(tasks: Iterable[asyncio.Task | None], within: float = STOP_WITHIN) -> None:
    """Cancel the tasks and wait until they have ended (at most twice `within` seconds)."""
    every = [t for t in tasks if t is not None]
    pending = {t for t in every if not t.done()}
    for _ in range(2):  # a second cancel, for one a library swallowed
        if not pending:
            break
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=within)
    if pending:
        names = sorted(t.get_name() for t in pending)
        log.error("background tasks did not stop; left behind", tasks=names)
    for task in every:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: an error at shutdown is not logged as unhandled
