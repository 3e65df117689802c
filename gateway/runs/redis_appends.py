"""Write-behind for a replica's own run logs: appends to Redis leave in one pipeline per tick.

The owner's followers read its runs from the local mirror, so Redis only has to keep up for
other replicas and for resumes. Appends are gathered for `TICK` and written together: one round
trip for every run with something new, instead of one per chunk per run. Order is kept per run
(one pipeline at a time, each run once in it). A run's terminal transition waits for its own
pending events first, so the final event's seq is right.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import structlog

from gateway.runs.store_redis import RedisRunStore

log = structlog.get_logger("sluice.runs")
TICK = 0.005  # seconds appends wait to travel together


class AppendBuffer:
    def __init__(self, shared: RedisRunStore, on_closed: Callable[[str], None]) -> None:
        """`on_closed(run_id)`: Redis refused a run's events (another replica ended it)."""
        self.shared = shared
        self.on_closed = on_closed
        self._pending: dict[str, list[bytes]] = {}
        self._flushing: dict[str, asyncio.Future[None]] = {}  # runs in the pipeline in flight
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def add(self, run_id: str, payloads: list[bytes]) -> None:
        self._pending.setdefault(run_id, []).extend(payloads)
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="redis appends")
        self._wake.set()

    async def settle(self, run_id: str) -> None:
        """Return once every event of the run added so far is in Redis."""
        while run_id in self._pending or run_id in self._flushing:
            if run_id in self._flushing:
                await asyncio.shield(self._flushing[run_id])
            else:
                await self._write({run_id: self._pending.pop(run_id)})

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self._write(dict(self._pending))
        self._pending.clear()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await asyncio.sleep(TICK)
            batch, self._pending = self._pending, {}
            if batch:
                await self._write(batch)

    async def _write(self, batch: dict[str, list[bytes]]) -> None:
        done = asyncio.get_running_loop().create_future()
        for run_id in batch:
            self._flushing[run_id] = done
        try:
            async with self.shared.redis.pipeline(transaction=False) as pipe:
                for run_id, payloads in batch.items():
                    await self.shared.queue_append(pipe, run_id, payloads)
                results = await pipe.execute(raise_on_error=False)
        except Exception as exc:  # Redis is away: the runs' endings will fail and say so
            log.error("run events not written to redis", runs=len(batch), error=type(exc).__name__)
            results = []
        finally:
            for run_id in batch:
                if self._flushing.get(run_id) is done:
                    del self._flushing[run_id]
            done.set_result(None)
        for run_id, result in zip(batch, results, strict=False):
            if result == -2:
                self.on_closed(run_id)
