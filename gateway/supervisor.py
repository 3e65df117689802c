"""Keeps the gateway's local workers alive: a worker that exits unasked is started again.

Restarts back off exponentially (0.5 s, 1 s, 2 s, … up to 30 s), and the backoff resets once a
worker has stayed up for a minute. A worker that dies `CRASH_LOOP_EXITS` times within
`CRASH_LOOP_WINDOW` is crash looping: that is logged as an error and shown by
`sluice_local_worker_crash_looping`; it is still restarted (at the longest backoff), because a
gateway that gives up serves nothing at all. Every exit and restart is a log line and a count.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import deque
from collections.abc import Callable

import structlog

from gateway.local_worker import LocalWorker
from gateway.metrics import GatewayMetrics

log = structlog.get_logger("sluice.supervisor")

FIRST_BACKOFF = 0.5
MAX_BACKOFF = 30.0
STABLE_AFTER = 60.0  # seconds up after which a worker's backoff starts again from the first
CRASH_LOOP_EXITS = 5
CRASH_LOOP_WINDOW = 300.0


class RestartPolicy:
    """When to restart a worker that exited, and whether it is crash looping."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._exits: deque[float] = deque()
        self._backoff = FIRST_BACKOFF
        self._started = clock()

    def started(self) -> None:
        self._started = self._clock()

    def exited(self) -> float:
        """Record an exit; the seconds to wait before the next start."""
        now = self._clock()
        if now - self._started >= STABLE_AFTER:
            self._backoff = FIRST_BACKOFF
        delay, self._backoff = self._backoff, min(self._backoff * 2, MAX_BACKOFF)
        self._exits.append(now)
        while self._exits and now - self._exits[0] > CRASH_LOOP_WINDOW:
            self._exits.popleft()
        return delay

    @property
    def crash_looping(self) -> bool:
        """Many exits lately, and not up for long since the last start."""
        now = self._clock()
        recent = sum(1 for t in self._exits if now - t <= CRASH_LOOP_WINDOW)
        return recent >= CRASH_LOOP_EXITS and now - self._started < STABLE_AFTER


def exit_reason(returncode: int) -> str:
    """`signal:SIGKILL` for a worker killed by a signal, `code:N` for one that exited."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal:{signal.Signals(-returncode).name}"
    return f"code:{returncode}"


class Supervisor:
    """One task per local worker, restarting it whenever it exits while the gateway runs."""

    def __init__(self, workers: list[LocalWorker], metrics: GatewayMetrics, ready_within: float):
        self.workers = workers
        self.metrics = metrics
        self.ready_within = ready_within
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch(w), name=f"supervise {w.name}") for w in self.workers
        ]

    def restart(self, name: str) -> None:
        """A worker whose engine is hung (the pool saw its steps stand still): kill it, and the
        watch loop starts it again, with the same backoff as any exit."""
        for worker in self.workers:
            if worker.name == name:
                log.error("worker hung; restarting it", member=name)
                worker.kill()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self.workers))

    async def _watch(self, worker: LocalWorker) -> None:
        policy = RestartPolicy()
        looping = self.metrics.local_worker_crash_looping.labels(worker.name)
        looping.set_function(lambda: int(policy.crash_looping))
        while True:
            code = await worker.wait()
            reason = exit_reason(code)
            delay = policy.exited()
            self.metrics.local_worker_exits.labels(worker.name, reason).inc()
            logger = log.error if policy.crash_looping else log.warning
            logger(
                "worker crash loop" if policy.crash_looping else "worker exited",
                member=worker.name,
                reason=reason,
                restart_in_s=delay,
            )
            await asyncio.sleep(delay)
            try:
                await worker.start(self.ready_within)
            except RuntimeError as exc:  # it died again while starting: the loop goes on
                log.warning("worker restart failed", member=worker.name, error=str(exc))
                continue
            policy.started()
            self.metrics.local_worker_restarts.labels(worker.name).inc()
            log.info("worker restarted", member=worker.name, url=worker.url)
