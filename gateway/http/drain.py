"""Graceful shutdown: on SIGTERM a replica drains before it closes (design §2).

A terminated replica (a Kubernetes pod, a rolling deploy) should cost its clients nothing they
cannot retry. So the drain, in order:

1. refuses new runs (503 `overloaded` with `retry-after`) and answers `/readyz` 503 `draining`,
   so the load balancer stops sending here; retrieve, resume and cancel of existing runs go on;
2. gives the runs this replica drives up to `--shutdown-timeout` to finish by themselves, and
   ends as soon as none is live (with none live, at once);
3. cancels those still live through their driver's one cancel path, source `shutdown`: the
   ending is written, the upstream is aborted, the run settles (usage, refund) as any cancel;
4. lets the streams that follow them write out the log's end and `[DONE]`.

Only then does aiohttp close the connections, and the backends and local workers stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import structlog

from gateway.http.errors import overloaded
from gateway.runs.endings import SHUTDOWN
from gateway.runs.manager import RunManager

log = structlog.get_logger("sluice.drain")

SETTLE_MARGIN = 1.0  # seconds past the cancel confirm timeout for cancelled runs to settle
STREAMS_WITHIN = 2.0  # seconds the streams of ended runs get to write their end and [DONE]
REFUSAL = "The gateway is shutting down; retry on another replica."


class Drain:
    """One replica's drain: the flag the handlers read, and the wait for its runs."""

    def __init__(self, timeout: float, settle_within: float) -> None:
        """`timeout`: how long live runs may take to finish by themselves; `settle_within`:
        how long runs cancelled after that get to settle (the cancel confirm timeout and a
        margin)."""
        self.timeout = timeout
        self.settle_within = settle_within
        self.draining = False
        self._hurry = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def begin(self) -> bool:
        """Stop taking new runs; False when the drain had already begun."""
        if self.draining:
            return False
        self.draining = True
        return True

    def hurry(self) -> None:
        """Stop waiting for live runs to finish by themselves (a second signal): they are
        cancelled now."""
        self._hurry.set()

    def refuse_new_runs(self) -> None:
        """Raise the 503 a new run gets while draining: the client retries on another
        replica (the openai SDK does so by itself, after `retry-after`)."""
        if self.draining:
            raise overloaded(REFUSAL)

    async def wait_idle(self, runs: RunManager, within: float) -> bool:
        """Until no run is live here (True), or `within` seconds passed or `hurry` was called
        (False)."""
        return await _until_idle(runs, within, self._hurry)

    async def run(
        self,
        runs: RunManager | None,
        streams: Iterable[asyncio.Task],
        within: float | None = None,
    ) -> None:
        """The whole drain, once: a second call waits for the first. `streams` are the tasks
        of the open stream handlers; `within` replaces the drain's own timeout."""
        if self._task is None:
            wait = self.timeout if within is None else within
            self._task = asyncio.create_task(self._drain(runs, streams, wait), name="drain")
        await asyncio.shield(self._task)

    async def _drain(
        self, runs: RunManager | None, streams: Iterable[asyncio.Task], within: float
    ) -> None:
        self.begin()
        if runs is None:  # the app never finished starting: no runs
            return
        live = len(_live(runs))
        if live == 0:
            return
        log.info("draining", live_runs=live, timeout=within)
        if not await self.wait_idle(runs, within):
            cut = [d.run_id for d in list(runs.drivers.values()) if d.cancel(SHUTDOWN)]
            log.warning("runs cancelled at shutdown", runs=len(cut))
            if not await _until_idle(runs, self.settle_within):
                log.error("runs did not settle at shutdown", runs=len(_live(runs)))
        # NOTE: the streams of runs that ended here write out their end within milliseconds;
        # one still open after this follows a run driven by another replica (or a client that
        # stopped reading) and is cut, so its client resumes elsewhere.
        open_streams = [t for t in streams if not t.done()]
        if open_streams:
            await asyncio.wait(open_streams, timeout=STREAMS_WITHIN)
        log.info("drained")


def _live(runs: RunManager) -> list[asyncio.Task]:
    """The driver tasks of the runs still live here."""
    tasks = (d.task for d in runs.drivers.values())
    return [t for t in tasks if t is not None and not t.done()]


async def _until_idle(runs: RunManager, within: float, hurry: asyncio.Event | None = None) -> bool:
    """Until no driver task is left (True), or `within` seconds passed or `hurry` is set (False).
    Runs started meanwhile (a request already past the refusal) are waited for too."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    hurried = asyncio.ensure_future(hurry.wait()) if hurry is not None else None
    try:
        while tasks := _live(runs):
            left = deadline - loop.time()
            if left <= 0 or (hurry is not None and hurry.is_set()):
                return False
            waits: list[asyncio.Future] = [*tasks, *([hurried] if hurried else [])]
            await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        return True
    finally:
        if hurried is not None:
            hurried.cancel()
