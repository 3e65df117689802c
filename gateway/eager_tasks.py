"""A task whose first step runs at once, in its caller's turn of the event loop.

`asyncio.create_task` only schedules a task: its first step waits for the loop's current turn to
end, and under load a turn is a burst of other streams' chunks (a few ms). A run's opening task
does the run's whole way to the upstream in its first step (claim, reserve, record, the
upstream request), so that wait sat in every first token. Python 3.12's eager tasks
(`eager_start`) remove it; on 3.11 this module does the same: the coroutine's first step runs
now, as the new task (`asyncio.current_task()` is the task, its context vars are the task's),
and the task itself then takes the coroutine on from where that step suspended. The same,
through the loop's task factory, for aiohttp's client writing a request's body (aiohttp starts
that task eagerly itself on 3.12).
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

from common.aiohttp_internals import writes_request_body

T = TypeVar("T")
TaskFactory = Callable[..., asyncio.Task[Any]]


def start_eagerly(coro: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
    """`coro` as a task of its own, its first step already run (to its first suspension)."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return asyncio.Task(coro, loop=loop, name=name, eager_start=True)
    return _start(loop, coro, name, None)


def eager_task_factory(starts_eagerly: Callable[[Coroutine[Any, Any, Any]], bool]) -> TaskFactory:
    """A task factory for the loop (`loop.set_task_factory`) that starts the coroutines
    `starts_eagerly` picks eagerly, every other one as usual."""

    def factory(
        loop: asyncio.AbstractEventLoop,
        coro: Coroutine[Any, Any, Any],
        context: contextvars.Context | None = None,
    ) -> asyncio.Task[Any]:
        if starts_eagerly(coro):
            return _start(loop, coro, None, context)
        return asyncio.Task(coro, loop=loop, context=context)

    return factory


def start_request_writes_eagerly(loop: asyncio.AbstractEventLoop) -> None:
    """aiohttp's client writes a request's body in a task of its own (`write_bytes`), on Python
    3.12 started eagerly, on 3.11 a plain task: every upstream request then left a turn of the
    loop after the run sent it. On 3.11 this loop starts those tasks eagerly too (where it has
    no task factory of its own already)."""
    if sys.version_info < (3, 12) and loop.get_task_factory() is None:
        loop.set_task_factory(eager_task_factory(writes_request_body))


def _start(
    loop: asyncio.AbstractEventLoop,
    coro: Coroutine[Any, Any, T],
    name: str | None,
    context: contextvars.Context | None,
) -> asyncio.Task[T]:
    outer = asyncio.current_task(loop)
    if outer is None:  # outside any task (a callback): nothing to step in the name of
        return asyncio.Task(coro, loop=loop, name=name, context=context)
    first = _FirstStep(coro)
    rest = first.rest()
    rest.send(None)  # primed: the task's first step resumes (or throws into) it there
    context = contextvars.copy_context() if context is None else context
    task = asyncio.Task(rest, loop=loop, name=name, context=context)
    asyncio.tasks._leave_task(loop, outer)
    asyncio.tasks._enter_task(loop, task)
    try:
        context.run(first.step)
    finally:
        asyncio.tasks._leave_task(loop, task)
        asyncio.tasks._enter_task(loop, outer)
    return task


class _FirstStep:
    """The coroutine's first step, run by `start_eagerly`; `rest` is what its task runs."""

    __slots__ = ("coro", "error", "finished", "result", "yielded")

    def __init__(self, coro: Coroutine[Any, Any, Any]) -> None:
        self.coro = coro
        self.finished = False
        self.yielded: Any = None  # what the step suspended on (a future, for the task)
        self.result: Any = None
        self.error: BaseException | None = None

    def step(self) -> None:
        try:
            self.yielded = self.coro.send(None)
        except StopIteration as stop:
            self.finished, self.result = True, stop.value
        except BaseException as exc:  # the task raises it, as if its own first step had
            self.finished, self.error = True, exc

    @types.coroutine
    def rest(self) -> Generator[Any, None, Any]:
        """What the task runs: hand it the future the first step suspended on, pass it what
        it throws (a cancel), then delegate the rest of the coroutine to it."""
        thrown: BaseException | None = None
        try:
            yield  # primed here by start_eagerly, before the first step runs
        except BaseException as exc:  # cancelled before its first turn
            thrown = exc
        if self.finished:
            if self.error is not None:
                raise self.error
            return self.result
        waiting_on = self.yielded
        while True:
            if thrown is not None:
                try:
                    waiting_on = self.coro.throw(thrown)
                except StopIteration as stop:
                    return stop.value
                thrown = None
            try:
                yield waiting_on
            except BaseException as exc:
                thrown = exc
                continue
            break
        return (yield from self.coro)
