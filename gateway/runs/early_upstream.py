"""A run's upstream stream begun while its record is on its way to Redis.

On Redis a new run's opening (its key's claim, its admission, its record) is one script, one
round trip; under load that round trip is most of what the gateway adds to a first token. Where
the opening can refuse nothing (no Idempotency-Key to claim, a tenant without limits, Redis not
known to be away), or is all but sure not to (a tenant far from its limits,
policies/headroom.py), the upstream need not wait for it: the request leaves at once and the
two overlap. Nothing is promised any sooner: the client hears of the run only once its record
is written, and where it cannot be (refused, Redis away), the stream begun is closed (which
aborts the work upstream) and the request is refused as before (design §2).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable

from adapters.base import Adapter
from adapters.events import Event
from adapters.requests import ChatRequest
from gateway.eager_tasks import start_eagerly


class EarlyUpstream:
    """The upstream stream of a run not yet opened, read as the adapter's own: its first batch
    is on the way in a task of its own (the upstream request leaves in the caller's step), the
    rest comes straight from the adapter's stream. Whoever does not read it closes it."""

    __slots__ = ("events", "first", "sent_at")

    def __init__(self, adapter: Adapter, chat: ChatRequest, run_id: str) -> None:
        self.sent_at = time.monotonic()
        self.events: AsyncIterator[list[Event]] = adapter.stream(chat, run_id)
        self.first: asyncio.Task[list[Event]] | None = start_eagerly(
            _first_batch(self.events), name=f"upstream {run_id}"
        )

    def __aiter__(self) -> EarlyUpstream:
        return self

    def __anext__(self) -> Awaitable[list[Event]]:
        """The first batch's task, then the adapter's stream itself (no layer of its own)."""
        first = self.first
        if first is None:
            return self.events.__anext__()
        self.first = None
        return first

    async def aclose(self) -> None:
        """Nobody reads on: stop waiting for the first batch, close the stream (which aborts
        the work upstream)."""
        first, self.first = self.first, None
        if first is not None and not first.done():
            first.cancel()
            await asyncio.wait([first])
        elif first is not None and not first.cancelled():
            first.exception()  # retrieved: a failure nobody reads is no "never retrieved"
        if isinstance(self.events, AsyncGenerator):
            with contextlib.suppress(Exception):
                await self.events.aclose()


async def _first_batch(events: AsyncIterator[list[Event]]) -> list[Event]:
    """The stream's first batch (StopAsyncIteration, which ends the reader's loop, when it
    ended with none)."""
    return await anext(events)
