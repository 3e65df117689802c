"""Whether each backend can take work, probed in the background so a request only reads a flag.

Every `interval` seconds each adapter's `ready()` is asked, bounded by `timeout`: a worker that
hangs (SIGSTOP, a wedged host) is seen as not ready within about `interval + timeout`, and a
request for a model none of whose backends is ready is refused at once with a 503 instead of
waiting out its queue deadline in the dark.

A local worker's exit does not wait for a probe (design §11): its supervisor tells the pools,
then `member_exited` here recomputes every flag from what the backends know now
(`can_serve()`), so `/readyz` stops saying 200 the moment the process is gone. A flag is only
raised by a probe, so a restarted process still loading never reads as ready; once its
supervisor sees it serve, `member_restarted` probes at once rather than at the next tick. A
backend that is not ready but has a member `restarting()` is one a request may wait for.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from adapters.base import Adapter
from adapters.fallback import FallbackAdapter
from gateway.tasks import stop_tasks

log = structlog.get_logger("sluice.health")


class BackendHealth:
    def __init__(self, adapters: list[Adapter], interval: float = 1.0, timeout: float = 1.0):
        self.adapters = adapters
        self.interval = interval
        self.timeout = timeout
        self._ready: dict[str, bool] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # probe now, not at the next tick

    async def start(self) -> None:
        """Probe everything once (so the first request already knows), then keep probing."""
        await self.probe()
        self._task = asyncio.create_task(self._run(), name="backend health")

    async def stop(self) -> None:
        await stop_tasks([self._task])

    def ready(self, adapter: Adapter) -> bool:
        if isinstance(adapter, FallbackAdapter):  # a model alias: while one of its targets is
            return any(self.ready(target) for target in adapter.target_adapters)
        return self._ready.get(adapter.name, False)

    def states(self) -> dict[str, bool]:
        return {a.name: self.ready(a) for a in self.adapters}

    def restarting(self, adapter: Adapter) -> list[str]:
        """The backend's members whose process is being restarted (a pool of local workers);
        none for a backend that has no such members."""
        restarting = getattr(adapter, "restarting", None)
        return [] if restarting is None else restarting()

    def member_exited(self, name: str) -> None:
        """A local worker's process exited (its supervisor's listener, after its pools'): every
        flag is recomputed now, not at the next probe. Only lowered: up again takes a probe."""
        for adapter in self.adapters:
            can_serve = getattr(adapter, "can_serve", None)
            if can_serve is not None and self.ready(adapter) and not can_serve():
                self._set(adapter, False)

    def member_restarted(self, name: str) -> None:
        """A restarted local worker serves (its supervisor saw its /health say so): probe now."""
        self._wake.set()

    async def probe(self) -> None:
        results = await asyncio.gather(*(self._probe(a) for a in self.adapters))
        for adapter, ok in zip(self.adapters, results, strict=True):
            self._set(adapter, ok)

    def _set(self, adapter: Adapter, ok: bool) -> None:
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
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval):
                    await self._wake.wait()
            self._wake.clear()
            await self.probe()
