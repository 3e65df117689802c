"""The runs this gateway replica drives, their followers, and the disconnect grace window.

A run lives apart from the connection that started it. Each follower (a streaming response,
a resume, a waiting non-stream request) attaches while it reads; when the last one detaches from
a live run, a grace timer starts, and if nobody attaches again before it ends the run is
cancelled with source `disconnect` (DESIGN §4).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from adapters.base import Adapter
from adapters.requests import ChatRequest
from gateway.runs.driver import Deadlines, RunDriver
from gateway.runs.store import RunRecord, RunStore, TerminalRecord


class RunManager:
    def __init__(self, store: RunStore, disconnect_grace: float = 10.0) -> None:
        self.store = store
        self.disconnect_grace = disconnect_grace
        self.drivers: dict[str, RunDriver] = {}
        self._followers: dict[str, int] = {}
        self._grace: dict[str, asyncio.TimerHandle] = {}

    async def start(
        self,
        chat: ChatRequest,
        adapter: Adapter,
        tenant: str,
        deadlines: Deadlines | None = None,
        run_id: str | None = None,
    ) -> RunDriver:
        """Create a run and start driving it; the caller attaches to follow it."""
        run_id = run_id or "chatcmpl-" + uuid.uuid4().hex
        await self.store.create(
            RunRecord(run_id, tenant, chat.model, time.time(), stream=chat.stream)
        )
        driver = RunDriver(self.store, adapter, run_id, chat, deadlines or Deadlines())
        self.drivers[run_id] = driver
        driver.start().add_done_callback(lambda _: self._forget(run_id))
        return driver

    def cancel(self, run_id: str, source: str) -> bool:
        """Cancel a run driven here; False when it is not (unknown, ended, or another replica)."""
        driver = self.drivers.get(run_id)
        if driver is None:
            return False
        driver.cancel(source)
        return True

    def attach(self, run_id: str) -> None:
        self._followers[run_id] = self._followers.get(run_id, 0) + 1
        timer = self._grace.pop(run_id, None)
        if timer is not None:
            timer.cancel()

    def detach(self, run_id: str) -> None:
        left = self._followers.get(run_id, 0) - 1
        if left > 0:
            self._followers[run_id] = left
            return
        self._followers.pop(run_id, None)
        if run_id in self.drivers and run_id not in self._grace:
            loop = asyncio.get_running_loop()
            self._grace[run_id] = loop.call_later(self.disconnect_grace, self._grace_over, run_id)

    def followers(self, run_id: str) -> int:
        return self._followers.get(run_id, 0)

    async def follow(self, run_id: str, after: int = 0) -> AsyncIterator[list[tuple[int, bytes]]]:
        """Events with seq > after, in order, as they come, until the run has ended and every
        event was read. Raises ResumeWindowExpired if `after` is no longer retained."""
        while True:
            events = await self.store.read(run_id, after)
            if events:
                after = events[-1][0]
                yield events
                continue
            record = await self.store.get(run_id)
            if record.status.is_terminal and record.last_seq <= after:
                return
            await self.store.wait(run_id, after)

    async def result(self, run_id: str) -> TerminalRecord:
        """Wait for the run's terminal record."""
        while True:
            record = await self.store.get(run_id)
            if record.terminal is not None:
                return record.terminal
            await self.store.wait(run_id, record.last_seq)

    async def close(self) -> None:
        """Shutdown: stop driving (runs left live are failed by the owner lease elsewhere)."""
        for timer in self._grace.values():
            timer.cancel()
        tasks = [d.task for d in self.drivers.values() if d.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _grace_over(self, run_id: str) -> None:
        self._grace.pop(run_id, None)
        if self.followers(run_id) == 0:
            self.cancel(run_id, "disconnect")

    def _forget(self, run_id: str) -> None:
        self.drivers.pop(run_id, None)
        timer = self._grace.pop(run_id, None)
        if timer is not None:
            timer.cancel()
