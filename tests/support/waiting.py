"""Waiting for the condition a test means, with a deadline (never a bare sleep).

Where no event or fake clock can tell a test that something happened (another process's state,
a metric another task records), it asks again until the condition holds; the deadline is
generous, so a busy machine costs time, not a flake, and a quick one waits no longer than needed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
POLL = 0.01


async def until(check: Callable[[], T | Awaitable[T]], what: str, within: float = 10.0) -> T:
    """The first truthy value of `check()` (a function or a coroutine function)."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        await asyncio.sleep(POLL)


def until_sync(check: Callable[[], T], what: str, within: float = 10.0) -> T:
    """`until` for tests outside an event loop (driving real processes)."""
    deadline = time.monotonic() + within
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {within} s waiting for {what}")
        time.sleep(POLL * 5)
