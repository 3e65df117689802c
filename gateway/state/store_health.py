"""What the gateway does while its shared store (Redis) is away.

`StoreHealth` says whether the store answers and since when it has not (the Redis client reports
failures, its prober the recovery). The outage grace (`--redis-outage-grace`) is measured against
it: within the grace a live run goes on and its writes wait (`redis_writes`), followers reading
from the store wait with `patiently`, and writes that must not be lost (a quota refund, an
idempotency key's ending) are retried by `DeferredWrites` when the store is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import structlog

from gateway.state.run_store import StoreUnavailable
from gateway.tasks import stop_tasks

log = structlog.get_logger("sluice.store")

PROBE_EVERY = 0.5  # seconds between pings while the store is away
T = TypeVar("T")


class StoreHealth:
    """Whether the store answers, as this replica's client last saw it. Without a shared store
    (one replica, in-process state) it is simply always available."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.unavailable_since: float | None = None
        self.recovered_at: float | None = None  # when it last came back
        self._back = asyncio.Event()
        self._back.set()
        self.on_failure: Callable[[], None] | None = None  # starts the prober

    @property
    def available(self) -> bool:
        return self.unavailable_since is None

    def unavailable_for(self) -> float:
        """Seconds since Redis was first seen away (0 while it answers)."""
        if self.unavailable_since is None:
            return 0.0
        return self._clock() - self.unavailable_since

    def failed(self) -> None:
        if self.unavailable_since is None:
            self.unavailable_since = self._clock()
            self._back.clear()
            log.warning("redis unavailable")
            if self.on_failure is not None:
                self.on_failure()

    def recovered(self) -> None:
        if self.unavailable_since is not None:
            log.info("redis available again", after_s=round(self.unavailable_for(), 3))
            self.unavailable_since = None
            self.recovered_at = self._clock()
            self._back.set()

    async def back(self) -> None:
        """Return once Redis answers again (at once if it does)."""
        await self._back.wait()

    def settled_for(self) -> float:
        """Seconds the store has answered since it last came back (inf if it never was away)."""
        if self.unavailable_since is not None:
            return 0.0
        if self.recovered_at is None:
            return float("inf")
        return self._clock() - self.recovered_at


async def patiently(
    health: StoreHealth, grace: float, call: Callable[..., Awaitable[T]], *args: Any
) -> T:
    """`call(*args)`, tried again while the store is away, until it has been away for `grace`
    seconds (then its StoreUnavailable is raised)."""
    while True:
        try:
            return await call(*args)
        except StoreUnavailable:
            health.failed()
            if health.unavailable_for() >= grace:
                raise
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(PROBE_EVERY):
                await health.back()


class DeferredWrites:
    """Writes that must not be lost to an outage (a quota refund, a usage record): tried now,
    and if Redis is away, again whenever it is back, for up to `max_age` seconds. What is still
    pending then, or at shutdown, is handed to its `give_up` (the ledger writes it to a file)."""

    def __init__(self, health: StoreHealth, max_age: float = 600.0) -> None:
        self.health = health
        self.max_age = max_age
        self._pending: list[tuple[float, str, Callable[[], Awaitable[None]], Any]] = []
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._pending)

    async def run(
        self,
        what: str,
        write: Callable[[], Awaitable[None]],
        give_up: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        try:
            await write()
        except StoreUnavailable:
            self._pending.append((time.monotonic(), what, write, give_up))
            log.warning("write deferred until redis is back", what=what)
            if self._task is None or self._task.done():
                self._task = asyncio.create_task(self._retry(), name="deferred writes")

    async def _retry(self) -> None:
        while self._pending:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PROBE_EVERY * 4):
                    await self.health.back()
            still: list[tuple[float, str, Callable[[], Awaitable[None]], Any]] = []
            for entry in self._pending:
                since, what, write, give_up = entry
                try:
                    await write()
                except StoreUnavailable:
                    if time.monotonic() - since < self.max_age:
                        still.append(entry)
                    else:
                        await _give_up(what, give_up)
            self._pending = still
            if still:
                await asyncio.sleep(PROBE_EVERY)

    async def close(self) -> None:
        """Shutdown: one last try for each, then their `give_up`."""
        await stop_tasks([self._task])
        pending, self._pending = self._pending, []
        for _, what, write, give_up in pending:
            try:
                async with asyncio.timeout(PROBE_EVERY * 2):
                    await write()
            except (StoreUnavailable, TimeoutError):
                await _give_up(what, give_up)


async def _give_up(what: str, give_up: Callable[[], Awaitable[None]] | None) -> None:
    if give_up is None:
        log.error("deferred write dropped: redis stayed away", what=what)
        return
    await give_up()
