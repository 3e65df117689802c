"""Whether each backend can take work, probed in the background so a request only reads a flag.

Every `interval` seconds each adapter's `ready()` is asked, bounded by `timeout`: a worker that
hangs (SIGSTOP, a wedged host) is seen as not ready within about `interval + timeout`, and a
request for a model none of whose backends is ready is refused at once with a 503 instead of
waiting out its queue deadline in the dark.
"""

from __future__ import annotations

import asyncio

import structlog

from adapters.base import Adapter
from gateway.tasks import stop_tasks

log = structlog.get_logger("sluice.health")


class BackendHealth:
    def __init__(self, adapters: list[Adapter], interval: float = 1.0, timeout: float = 1.0):
        self.adapters = adapters
        self.interval = interval
        self.timeout = timeout
        self._ready: dict[str, bool] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Probe everything once (so the first request already knows), then keep probing."""
        await self.probe()
        self._task = asyncio.create_task(self._run(), name="backend health")

    async def stop(self) -> None:
        await stop_tasks([self._task])

    def ready(self, adapter: Adapter) -> bool:
        return self._ready.get(adapter.name, False)

    def states(self) -> dict[str, bool]:
        return {a.name: self.ready(a) for a in self.adapters}

    async def probe(self) -> None:
        results = await asyncio.gather(*(self._probe(a) for a in self.adapters))
        for adapter, ok in zip(self.adapters, results, strict=True):
            if self._ready.get(adapter.name) != ok:
                (log.info if ok else log.warning)(
                    "backend ready" if ok else "backend not ready", backend=adapter.name
                )
            self._ready[adapter.name] = ok

    async def _probe(self, adapter: Adapter) -> bool:
        try:
            async with asyncio.timeout(self.timeout):
                return await adapter.ready()
        except TimeoutError:
            return False

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.probe()
