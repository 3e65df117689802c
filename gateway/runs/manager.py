"""The runs this gateway replica drives, their followers, and the disconnect grace window.

A run lives apart from the connection that started it. Each follower (a streaming response, a
resume, a waiting non-stream request) is counted in the store while it reads, so replicas see
each other's followers; when the count falls to zero on a live run, a grace timer starts, and
if nobody follows again before it ends the run is cancelled with source `disconnect`
(design §2). A cancel for a run driven by another replica travels through the store. Each
replica renews an owner lease; a follower that finds a live run whose owner's lease lapsed
marks it failed, so nobody waits on a dead replica forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import structlog

from gateway.metrics import GatewayMetrics
from gateway.runs.driver import BeforeEnding, RunDriver, Settle
from gateway.runs.early_upstream import EarlyUpstream
from gateway.runs.endings import LOST_CAUSE, ending
from gateway.runs.spec import RunSpec
from gateway.runs.stages import build_stages
from gateway.runs.status import RunStatus
from gateway.state.run_store import (
    Deliver,
    LogEvents,
    RunRecord,
    RunStore,
    StoreUnavailable,
    TerminalRecord,
    UnknownRun,
)
from gateway.state.store_health import StoreHealth, patiently
from gateway.tasks import stop_tasks
from safety.moderation import ModerationClient

log = structlog.get_logger("sluice.runs")
T = TypeVar("T")
SHUTDOWN_WITHIN = 5.0  # seconds a driver gets to write its ending and settle at shutdown


def new_run_id() -> str:
    """A run's id, which is also its completion id (`chatcmpl-…`)."""
    return "chatcmpl-" + uuid.uuid4().hex


class RunManager:
    def __init__(
        self,
        store: RunStore,
        metrics: GatewayMetrics | None = None,
        *,
        disconnect_grace: float = 10.0,
        confirm_timeout: float = 5.0,
        lease_ttl: float | None = None,
        owner: str | None = None,
        health: StoreHealth | None = None,
        outage_grace: float = 30.0,
    ) -> None:
        """`lease_ttl` None: one replica (in-process store), no leases to keep or check.
        `health` is the shared store's; its outages past `outage_grace` end the runs here."""
        self.store = store
        self.metrics = metrics or GatewayMetrics()
        self.disconnect_grace = disconnect_grace
        self.confirm_timeout = confirm_timeout
        self.lease_ttl = lease_ttl
        self.owner = owner or uuid.uuid4().hex[:12]
        self.health = health or StoreHealth()
        self.outage_grace = outage_grace
        self.drivers: dict[str, RunDriver] = {}
        self._grace: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self.moderation = ModerationClient()  # remote safety checks: one HTTP session

    # -- life of the replica --------------------------------------------------------------------

    async def open(self) -> None:
        """Start the background work: the owner lease and, with replicas, the cancel listener."""
        if self.lease_ttl is not None:
            await self.store.keep_alive(self.owner, self.lease_ttl)
            self._spawn(self._keep_lease(self.lease_ttl))
            self._spawn(self._listen_for_cancels())
            self._spawn(self._watch_outages())

    async def close(self) -> None:
        """Shutdown: stop driving (runs left live elsewhere are failed by the owner lease)."""
        for timer in self._grace.values():
            timer.cancel()
        # NOTE: a driver's shutdown writes its ending and settles (each Redis call bounded by
        # --redis-timeout), so drivers get longer than the replica's own loops
        await stop_tasks(list(self._tasks))
        await stop_tasks([d.task for d in self.drivers.values()], within=SHUTDOWN_WITHIN)
        await self.moderation.close()

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _keep_lease(self, ttl: float) -> None:
        while True:
            await asyncio.sleep(ttl / 3)
            try:
                await self.store.keep_alive(self.owner, ttl)
            except StoreUnavailable:  # renewed the moment the store is back
                await self.health.back()
                with contextlib.suppress(StoreUnavailable):
                    await self.store.keep_alive(self.owner, ttl)

    async def _watch_outages(self) -> None:
        """A store away for longer than the grace: end the runs driven here (their state can
        no longer be kept), so no client waits on them for ever."""
        while True:
            await asyncio.sleep(min(1.0, self.outage_grace / 4))
            if self.health.unavailable_for() < self.outage_grace:
                continue
            for driver in list(self.drivers.values()):
                if driver.lose_store():
                    log.error("run ended: the store stayed away", run_id=driver.run_id)

    async def _listen_for_cancels(self) -> None:
        async for run_id, source in self.store.cancel_signals():
            driver = self.drivers.get(run_id)
            if driver is not None:
                driver.cancel(source)

    # -- runs ------------------------------------------------------------------------------------

    def record_for(self, spec: RunSpec) -> RunRecord:
        """The new run's record, as this replica creates it."""
        chat = spec.chat
        record = RunRecord(
            spec.run_id, spec.tenant, chat.model, time.time(), stream=chat.stream, owner=self.owner
        )
        record.meta.update(spec.meta)
        if chat.share is not None:  # the tier serving it, echoed by chunks rendered later
            record.meta["service_tier"] = chat.share.tier
        if spec.safety is not None:  # what policy judged this run's text (design §3)
            record.meta["safety"] = {"policy": spec.safety.name, "digest": spec.safety.digest}
        return record

    async def start(
        self,
        spec: RunSpec,
        settle: Settle | None = None,
        record: RunRecord | None = None,
        *,
        here: bool = False,
        early: EarlyUpstream | None = None,
        before_ending: BeforeEnding | None = None,
    ) -> RunDriver:
        """Create the run and start driving it; `settle` runs with its outcome once it is over.
        The caller attaches to follow it. `record`: the store has it already (from
        `record_for`, written with the request's claim and admission). `here`: the calling
        task drives it: the caller awaits the driver's `run()` next (RunDriver.adopt).
        `early`: its upstream stream, begun while it opened; the driver owns it from here.
        `before_ending`: RunDriver's."""
        if record is None:
            record = self.record_for(spec)
            await self.store.create(record)
        if spec.trace is not None:  # its span opens now; it ends as the run settles
            settle = spec.trace.start(spec, settle)
        driver = RunDriver(
            spec,
            self.store,
            metrics=self.metrics,
            confirm_timeout=self.confirm_timeout,
            settle=settle,
            stages=build_stages(spec, self.metrics, self.moderation),
            created=int(record.created),
            early=early,
            before_ending=before_ending,
        )
        self.drivers[spec.run_id] = driver
        task = driver.adopt() if here else driver.start()
        task.add_done_callback(lambda _: self._forget(spec.run_id))
        return driver

    def cancel_here(self, run_id: str, source: str) -> bool:
        """Cancel a run this replica drives; False when it is not driven here or has ended."""
        driver = self.drivers.get(run_id)
        return driver is not None and driver.cancel(source)

    async def cancel(self, run_id: str, source: str) -> None:
        """Cancel a run wherever it is driven (idempotent; a no-op once it has ended)."""
        driver = self.drivers.get(run_id)
        if driver is not None:
            driver.cancel(source)
        else:
            await self.store.signal_cancel(run_id, source)

    async def get(self, run_id: str) -> RunRecord:
        """The run's record, after failing it if its owner is gone. Raises UnknownRun."""
        record = await self.store.get(run_id)
        if record.status.is_terminal or self.lease_ttl is None or record.owner == self.owner:
            return record
        # NOTE: right after an outage every owner's lease may have lapsed; each renews its own
        # as soon as the store is back, so nobody is judged until a lease's time has passed.
        if self.health.settled_for() < self.lease_ttl:
            return record
        if await self.store.owner_alive(record.owner):
            return record
        lost, frame = ending(RunStatus.FAILED, LOST_CAUSE)
        if await self.store.finish(run_id, lost, frame):
            log.warning("run failed: its replica is gone", run_id=run_id, owner=record.owner)
        return await self.store.get(run_id)

    # -- followers -------------------------------------------------------------------------------

    async def attach(self, run_id: str) -> None:
        self._end_grace(run_id)
        await self.store.add_follower(run_id, 1)

    def attach_now(self, run_id: str) -> bool:
        """`attach` where the store counts the follower with no round trip; False where it
        cannot (nothing was counted: await `attach`)."""
        self._end_grace(run_id)
        return self.store.add_follower_now(run_id, 1) is not None

    def _end_grace(self, run_id: str) -> None:
        timer = self._grace.pop(run_id, None)
        if timer is not None:
            timer.cancel()

    async def detach(self, run_id: str) -> None:
        if await self.store.add_follower(run_id, -1) > 0:
            return
        if run_id in self._grace or await self._has_ended(run_id):
            return
        loop = asyncio.get_running_loop()
        self._grace[run_id] = loop.call_later(
            self.disconnect_grace, lambda: self._spawn(self._grace_over(run_id))
        )

    async def _has_ended(self, run_id: str) -> bool:
        """Whether the run has ended, so its last follower leaving starts nothing. NOTE: that
        is how every stream that read to the end leaves; a grace timer each would wake a task
        per run, `disconnect_grace` later, to find the run ended. Unknown while the store is
        away: the timer's check waits for it."""
        try:
            return (await self.store.get(run_id)).status.is_terminal
        except StoreUnavailable:
            return False

    def in_grace(self, run_id: str) -> bool:
        """Whether the run has no followers here and its disconnect grace window is running."""
        return run_id in self._grace

    async def followers(self, run_id: str) -> int:
        return await self.store.followers(run_id)

    async def follow(
        self, run_id: str, after: int = 0, limit: int = 0, deliver: Deliver | None = None
    ) -> AsyncIterator[LogEvents]:
        """Events with seq > after, in order, as they come, until the run has ended and every
        event was read. Raises ResumeWindowExpired if `after` is no longer retained. While the
        follower is caught up on a run driven here, new events go to `deliver` as the driver
        appends them (for as long as it takes them) and are not yielded."""
        check_every = None if self.lease_ttl is None else self.lease_ttl / 2
        events = await self._patiently(self.store.read, run_id, after, limit)
        while True:
            if events:
                after = events[-1][0]
                yield events
                # NOTE: wait first, read after: a live follower then costs one wake-up and one
                # read per batch the driver appends, not an extra empty read and record fetch;
                # and none at all while `deliver` takes the batches.
                after = await self._patiently(self._wait, run_id, after, check_every, deliver)
                events = await self._patiently(self.store.read, run_id, after, limit)
                continue
            record = await self._patiently(self.get, run_id)
            if record.status.is_terminal and record.last_seq <= after:
                return
            if record.last_seq <= after:
                after = await self._patiently(self._wait, run_id, after, check_every, deliver)
            events = await self._patiently(self.store.read, run_id, after, limit)

    async def result(self, run_id: str) -> TerminalRecord:
        """Wait for the run's terminal record."""
        check_every = None if self.lease_ttl is None else self.lease_ttl / 2
        while True:
            record = await self._patiently(self.get, run_id)
            if record.terminal is not None:
                return record.terminal
            await self._patiently(self._wait, run_id, record.last_seq, check_every)

    def _patiently(self, call: Callable[..., Awaitable[T]], *args: Any) -> Awaitable[T]:
        """A store call that waits out an outage shorter than the grace. NOTE: it hands back
        `patiently`'s coroutine itself: a follower makes two of these per chunk it relays."""
        return patiently(self.health, self.outage_grace, call, *args)

    async def _wait(
        self, run_id: str, after: int, within: float | None, deliver: Deliver | None = None
    ) -> int:
        """The store's wait; returns the last seq `deliver` took (`after` when none)."""
        # NOTE: `within` bounds a wait so a run whose owner died is noticed; a run driven here
        # has no lease to check, and its followers wake on every batch: no timer per wait. Only
        # such a run's events can be delivered (a bounded wait that ran out would lose them).
        if within is None or run_id in self.drivers:
            return await self.store.wait(run_id, after, deliver)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                await self.store.wait(run_id, after)
        return after

    async def _grace_over(self, run_id: str) -> None:
        self._grace.pop(run_id, None)
        try:
            record = await self.store.get(run_id)
            background = record.meta.get("background", False)  # runs with nobody attached
            if (
                not record.status.is_terminal
                and not background
                and await self.followers(run_id) == 0
            ):
                await self.cancel(run_id, "disconnect")
        except StoreUnavailable:  # ask again when the store is back
            await self.health.back()
            self._spawn(self._grace_over(run_id))
        except UnknownRun:
            pass

    def _forget(self, run_id: str) -> None:
        self.drivers.pop(run_id, None)
        timer = self._grace.pop(run_id, None)
        if timer is not None:
            timer.cancel()
