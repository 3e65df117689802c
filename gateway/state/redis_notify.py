"""One pub/sub connection per Redis run store, shared by everything on this replica.

Followers waiting on a run subscribe to its channel through `watching`; the reader task sets
their events as messages come. Subscriptions outlive their last watcher for a few seconds,
because a follower waits again right after each batch it reads and re-subscribing every time
would cost two commands per batch. The replica-wide cancel channel feeds `cancels`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from redis.asyncio import Redis
from redis.asyncio.client import PubSub

from gateway.state.redis_client import REDIS_ERRORS
from gateway.state.run_store import StoreUnavailable
from gateway.tasks import stop_tasks

LINGER = 5.0  # seconds a channel stays subscribed with nobody watching
_ENDED = float("inf")


class Notifier:
    def __init__(self, redis: Redis, cancel_channel: str) -> None:
        self.redis = redis
        self.cancel_channel = cancel_channel
        self._pubsub: PubSub | None = None
        self._reader: asyncio.Task[None] | None = None
        self._starting: asyncio.Lock | None = None
        self._waiters: dict[str, set[asyncio.Event]] = {}
        self._idle_since: dict[str, float] = {}
        self._latest: dict[str, float] = {}  # per run channel: the last seq known ("end": inf)
        self._cancels: asyncio.Queue[tuple[str, str]] = asyncio.Queue()

    async def _start(self) -> PubSub:
        if self._pubsub is not None:
            return self._pubsub
        if self._starting is None:
            self._starting = asyncio.Lock()
        async with self._starting:
            if self._pubsub is None:
                pubsub = self.redis.pubsub()
                try:
                    await pubsub.subscribe(self.cancel_channel)
                except REDIS_ERRORS as exc:
                    raise StoreUnavailable(type(exc).__name__) from exc
                self._reader = asyncio.create_task(self._read(pubsub), name="redis notify")
                self._pubsub = pubsub
        return self._pubsub

    @contextlib.asynccontextmanager
    async def watching(self, channel: str) -> AsyncIterator[asyncio.Event]:
        """An event set whenever something is published on `channel`."""
        pubsub = await self._start()
        changed = asyncio.Event()
        waiters = self._waiters.setdefault(channel, set())
        if channel not in self._idle_since and not waiters:
            try:
                await pubsub.subscribe(channel)
            except REDIS_ERRORS as exc:
                raise StoreUnavailable(type(exc).__name__) from exc
        self._idle_since.pop(channel, None)
        waiters.add(changed)
        try:
            yield changed
        finally:
            waiters.discard(changed)
            if not waiters:
                self._idle_since[channel] = time.monotonic()

    def latest(self, channel: str) -> float | None:
        """The newest event seq of a subscribed run channel known here (inf once it ended),
        or None when nothing has been learnt since the channel was subscribed."""
        return self._latest.get(channel)

    def note(self, channel: str, seq: float) -> float:
        """Record what a read of the run's record showed; returns the newest known."""
        latest = max(seq, self._latest.get(channel, 0))
        self._latest[channel] = latest
        return latest

    def forget(self, channel: str) -> None:
        self._latest.pop(channel, None)

    async def cancels(self) -> AsyncIterator[tuple[str, str]]:
        """(run id, source) for every cancel published by any replica."""
        await self._start()
        while True:
            yield await self._cancels.get()

    async def close(self) -> None:
        await stop_tasks([self._reader])
        if self._pubsub is not None:
            await self._pubsub.aclose()
        self._pubsub = self._reader = None

    async def _read(self, pubsub: PubSub) -> None:
        while True:
            try:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None:
                    self._dispatch(message["channel"].decode(), message["data"])
                await self._unsubscribe_idle(pubsub)
            except REDIS_ERRORS:
                # NOTE: redis-py reconnects on the next use and subscribes again to every
                # channel; what was published meanwhile is missed, which the waiters' poll
                # interval covers (they look at the record again).
                self._latest.clear()
                await asyncio.sleep(0.5)

    def _dispatch(self, channel: str, data: bytes) -> None:
        if channel == self.cancel_channel:
            run_id, _, source = data.decode().partition(" ")
            self._cancels.put_nowait((run_id, source or "client"))
            return
        if channel in self._waiters:
            seq = _ENDED if data == b"end" else float(data)
            self._latest[channel] = max(seq, self._latest.get(channel, 0))
        for changed in self._waiters.get(channel, ()):
            changed.set()

    async def _unsubscribe_idle(self, pubsub: PubSub) -> None:
        cutoff = time.monotonic() - LINGER
        stale = [c for c, since in self._idle_since.items() if since < cutoff]
        for channel in stale:
            del self._idle_since[channel]
            if not self._waiters.get(channel):
                self._waiters.pop(channel, None)
                self._latest.pop(channel, None)
                await pubsub.unsubscribe(channel)
