"""Keeps the gateway's local workers alive: a worker that exits unasked is started again.

Restarts back off exponentially (0.5 s, 1 s, 2 s, … up to 30 s), and the backoff resets once a
worker has stayed up for a minute. A start that fails (the worker dies or is not ready in time,
or its process cannot be created) counts as an exit too, so a worker that never comes up backs
off like one that keeps crashing. `CRASH_LOOP_EXITS` exits in a row without a minute up in
between is a crash loop: that is logged as an error and shown by
`sluice_local_worker_crash_looping`; the worker is still restarted (at the longest backoff),
because a gateway that gives up serves nothing at all. Every exit and restart is a log line and a
count.

Whoever routes to the workers hears of it as it happens (design §6, The pool): `exit_listeners`
the moment a process exits (out of routing and readiness then, not at the next probe), and
`restart_listeners` once a restart serves (probe it now). `crash_looping(name)` tells a worker
worth waiting for (a restart under way) from one that is not: a request for a model whose only
worker is restarting waits for it, queued; one whose worker crash loops is refused at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable

import structlog

from gateway.backends.local_worker import LocalWorker
from gateway.metrics import GatewayMetrics

log = structlog.get_logger("sluice.supervisor")

FIRST_BACKOFF = 0.5
MAX_BACKOFF = 30.0
STABLE_AFTER = 60.0  # seconds up after which a worker's backoff starts again from the first
CRASH_LOOP_EXITS = 5
START_FAILED = "start_failed"  # the exit reason of a start that did not come up


class RestartPolicy:
    """When to restart a worker that exited, and whether it is crash looping: both follow the
    streak of exits (failed starts included) since the worker last stayed up `STABLE_AFTER`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._up_since: float | None = clock()  # None while it is down or starting
        self._streak = 0
        self._backoff = FIRST_BACKOFF

    def started(self) -> None:
        """The worker came up (it serves)."""
        self._up_since = self._clock()

    def exited(self) -> float:
        """Record an exit, or a start that did not come up; the seconds to wait before the next
        start."""
        if self._stable():
            self._streak, self._backoff = 0, FIRST_BACKOFF
        self._up_since = None
        self._streak += 1
        delay, self._backoff = self._backoff, min(self._backoff * 2, MAX_BACKOFF)
        return delay

    def _stable(self) -> bool:
        return self._up_since is not None and self._clock() - self._up_since >= STABLE_AFTER

    @property
    def crash_looping(self) -> bool:
        """Many exits in a row, and not up for long since."""
        return self._streak >= CRASH_LOOP_EXITS and not self._stable()


def exit_reason(returncode: int) -> str:
    """`signal:SIGKILL` for a worker killed by a signal, `code:N` for one that exited."""
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal:{signal.Signals(-returncode).name}"
    return f"code:{returncode}"


class Supervisor:
    """One task per local worker, restarting it whenever it exits while the gateway runs."""

    def __init__(
        self,
        workers: list[LocalWorker],
        metrics: GatewayMetrics,
        ready_within: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """`clock` and `sleep` drive the backoff (a test's fake clock)."""
        self.workers = workers
        self.metrics = metrics
        self.ready_within = ready_within
        self._clock = clock
        self._sleep = sleep
        self._tasks: list[asyncio.Task[None]] = []
        self._policies: dict[str, RestartPolicy] = {}  # by worker name
        # told a worker's name the moment its process exits (a pool takes it out of routing
        # then, rather than at its next probe), in order: the pools first, then readiness
        self.exit_listeners: list[Callable[[str], None]] = []
        # told a worker's name once its restart serves (its /health said ready)
        self.restart_listeners: list[Callable[[str], None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch(w), name=f"supervise {w.name}") for w in self.workers
        ]

    def crash_looping(self, name: str) -> bool:
        """Whether the worker `name` keeps exiting (see RestartPolicy): not worth waiting for.
        False for a worker this supervisor does not own."""
        policy = self._policies.get(name)
        return policy is not None and policy.crash_looping

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
        policy = self._policies[worker.name] = RestartPolicy(self._clock)
        looping = self.metrics.local_worker_crash_looping.labels(worker.name)
        looping.set_function(lambda: int(policy.crash_looping))
        while True:
            reason = exit_reason(await worker.wait())
            for listener in self.exit_listeners:
                listener(worker.name)
            while not await self._restart(worker, policy, reason):
                reason = START_FAILED
            for listener in self.restart_listeners:
                listener(worker.name)

    async def _restart(self, worker: LocalWorker, policy: RestartPolicy, reason: str) -> bool:
        """Count the exit, wait out the backoff and start the worker again; whether it came up."""
        delay = policy.exited()
        self.metrics.local_worker_exits.labels(worker.name, reason).inc()
        logger = log.error if policy.crash_looping else log.warning
        logger(
            "worker crash loop" if policy.crash_looping else "worker exited",
            member=worker.name,
            reason=reason,
            restart_in_s=delay,
        )
        await self._sleep(delay)
        self.metrics.local_worker_restarts.labels(worker.name).inc()
        try:
            await worker.start(self.ready_within)
        except (RuntimeError, OSError) as exc:  # it died or hung while starting, or never ran
            log.warning("worker restart failed", member=worker.name, error=str(exc))
            return False
        policy.started()
        log.info("worker restarted", member=worker.name, url=worker.url)
        return True
