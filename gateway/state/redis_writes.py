"""Write-behind for the runs a replica drives: their changes reach Redis in one pipeline per tick.

The owner serves its own followers from its local mirror, so Redis only has to keep up for other
replicas and for resumes elsewhere. Every change the owner makes to a run it drives (events, status
advances, its ending, its follower count) is queued here in order and written with everything
else queued in the same `TICK`: one round trip for all runs instead of one per chunk per run.

Each write is idempotent (events and endings carry their seq numbers, follower counts are
absolute), so a pipeline cut off by a lost connection is simply sent again. While Redis is away
the queue holds; writing resumes the moment it answers, in the original order per run. A run that
Redis no longer knows (it restarted empty) is written back whole from the mirror. A run that
Redis refuses because another replica ended it (it took this one for dead) is reported to
`on_closed`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from redis.exceptions import NoScriptError

from gateway.runs.status import RunStatus
from gateway.state.redis_client import REDIS_ERRORS
from gateway.state.redis_scripts import ScriptBatch
from gateway.state.run_store import Chunk, LogEvents, RunRecord, StoreUnavailable, TerminalRecord
from gateway.state.run_store_redis import RedisRunStore
from gateway.state.store_health import StoreHealth
from gateway.tasks import stop_tasks

log = structlog.get_logger("sluice.runs")
# NOTE: seconds writes wait to travel together. Each tick costs the gateway a pipeline (pack,
# send, read, parse, a wake-up) whatever it carries: at 64 streams x 20 ms/token a 5 ms tick
# made the Redis store 1.36x the in-process CPU per chunk, a 20 ms one 1.13x. Only other
# replicas' readers see the lag (the owner's read its mirror), at most one token at 50/s.
TICK = 0.02
RETRY_EVERY = 0.5  # seconds between tries while Redis is away
UNKNOWN, CLOSED = -1, -2  # what the scripts answer for a run Redis lacks, or that has ended

Snapshot = Callable[[str], tuple[RunRecord, LogEvents, int] | None]


@dataclass(slots=True)
class _Append:
    first_seq: int
    chunks: list[Chunk]


@dataclass(slots=True)
class _Advance:
    status: RunStatus


@dataclass(slots=True)
class _Finish:
    terminal: TerminalRecord
    final: Chunk | None
    final_seq: int


@dataclass(slots=True)
class _Followers:
    count: int


@dataclass(slots=True)
class _Restore:
    """The whole run as the mirror has it: record, kept events, this replica's followers."""


Op = _Append | _Advance | _Finish | _Followers | _Restore


@dataclass(slots=True)
class _RunQueue:
    ops: list[Op] = field(default_factory=list)
    queued: int = 0  # ops ever queued for the run
    written: int = 0  # of those, how many Redis has
    waiters: list[tuple[int, asyncio.Future[None]]] = field(default_factory=list)


class WriteBehind:
    def __init__(
        self,
        shared: RedisRunStore,
        health: StoreHealth,
        snapshot: Snapshot,
        on_closed: Callable[[str], None],
    ) -> None:
        """`snapshot(run_id)`: (record, kept events, local followers) from the mirror, for a
        run Redis lost; `on_closed(run_id)`: another replica ended the run."""
        self.shared = shared
        self.health = health
        self.snapshot = snapshot
        self.on_closed = on_closed
        self._runs: dict[str, _RunQueue] = {}
        self._pending: dict[str, list[Op]] = {}  # not yet in a pipeline
        self._wake = asyncio.Event()
        self._hurry = False  # someone waits: skip the tick
        self._task: asyncio.Task[None] | None = None

    # -- queueing -------------------------------------------------------------------------------

    def append(self, run_id: str, first_seq: int, chunks: list[Chunk]) -> None:
        ops = self._pending.get(run_id)
        last = ops[-1] if ops else None
        if type(last) is _Append and last.first_seq + len(last.chunks) == first_seq:
            last.chunks.extend(chunks)  # one script call for a run's events of a tick
            return
        self._add(run_id, _Append(first_seq, list(chunks)))

    def advance(self, run_id: str, status: RunStatus) -> None:
        self._add(run_id, _Advance(status))

    def finish(self, run_id: str, terminal: TerminalRecord, final: Chunk | None, seq: int) -> None:
        self._add(run_id, _Finish(terminal, final, seq))

    def followers(self, run_id: str, count: int) -> None:
        self._add(run_id, _Followers(count))

    def _add(self, run_id: str, op: Op) -> None:
        self._pending.setdefault(run_id, []).append(op)
        self._runs.setdefault(run_id, _RunQueue()).queued += 1
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="redis writes")
        self._wake.set()

    async def settle(self, run_id: str) -> bool:
        """Wait until everything queued for the run so far is in Redis: True. False at once
        while Redis is away (the writes stay queued and go out when it is back)."""
        queue = self._runs.get(run_id)
        if queue is None or queue.written >= queue.queued:
            return True
        if not self.health.available:
            return False
        done = asyncio.get_running_loop().create_future()
        queue.waiters.append((queue.queued, done))
        self._hurry = True
        self._wake.set()
        await asyncio.shield(done)
        return queue.written >= queue.queued or self.health.available

    def forget(self, run_id: str) -> None:
        """The run is done here and its writes are out: stop tracking it."""
        queue = self._runs.get(run_id)
        if queue is not None and queue.written >= queue.queued and run_id not in self._pending:
            del self._runs[run_id]

    # -- writing --------------------------------------------------------------------------------

    async def _run(self) -> None:
        # NOTE: a tick begins with the first write queued after the last batch left, so under a
        # steady stream batches leave a TICK apart, not back to back as fast as Redis answers
        # (each batch costs a write, a read and a wakeup here, whatever it carries).
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._hurry:
                await asyncio.sleep(TICK)
            self._hurry = False
            batch, self._pending = self._pending, {}
            if batch and not await self._write(batch):
                self._requeue(batch)
                self._release_waiters()  # settle() says "not now" instead of hanging
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RETRY_EVERY):
                        await self.health.back()
                self._hurry = True  # back (or a retry is due): no tick's wait on top
            if self._pending:  # queued meanwhile, or runs to write back whole
                self._wake.set()

    def _requeue(self, batch: dict[str, list[Op]]) -> None:
        """Put a batch that did not go out back in front of what was queued meanwhile."""
        newer, self._pending = self._pending, {}
        for run_id, ops in batch.items():
            self._pending[run_id] = ops + newer.pop(run_id, [])
        self._pending.update(newer)

    async def _write(self, batch: dict[str, list[Op]], again: bool = True) -> bool:
        """One pipeline for the batch, one apply script for all its calls but the restores
        (which go first, so a run written back whole gets what followed after it); False
        when Redis could not be reached."""
        calls = ScriptBatch()
        plan: list[tuple[str, Op, int]] = []  # run, op, its answer's index (-1: a restore)
        try:
            async with self.shared.redis.pipeline(transaction=False) as pipe:
                for run_id, ops in batch.items():
                    for op in ops:
                        plan.append((run_id, op, self._queue(pipe, calls, run_id, op)))
                if calls.count:
                    self.shared.queue_batch(pipe, calls)
                results = await pipe.execute(raise_on_error=False)
            if again and any(isinstance(result, NoScriptError) for result in results):
                # NOTE: Redis came back without the scripts: load them, send it all again
                # (every write is idempotent, so what did go through is not doubled)
                await self.shared.load_scripts()
                return await self._write(batch, again=False)
        except (StoreUnavailable, *REDIS_ERRORS) as exc:
            self.health.failed()
            log.warning("run writes held until redis is back", error=type(exc).__name__)
            return False
        self._settle_results(batch, plan, results[-1] if calls.count else [])
        return True

    def _queue(self, pipe: Any, calls: ScriptBatch, run_id: str, op: Op) -> int:
        s = self.shared
        if type(op) is _Append:
            return s.queue_append(calls, run_id, op.chunks, op.first_seq)
        if type(op) is _Advance:
            return s.queue_advance(calls, run_id, op.status)
        if type(op) is _Finish:
            return s.queue_finish(calls, run_id, op.terminal, op.final, op.final_seq)
        if type(op) is _Followers:
            return s.queue_followers(calls, run_id, op.count)
        snap = self.snapshot(run_id)
        if snap is not None:
            record, events, followers = snap
            s.queue_restore(pipe, record, events)
            s.queue_followers(pipe, run_id, followers)
        return -1

    def _settle_results(
        self, batch: dict[str, list[Op]], plan: list[tuple[str, Op, int]], answers: Any
    ) -> None:
        lost: set[str] = set()
        closed: set[str] = set()
        for run_id, op, index in plan:
            if index < 0:
                continue
            result = answers if isinstance(answers, Exception) else answers[index]
            if isinstance(result, Exception):
                log.error("run write refused by redis", run_id=run_id, error=type(result).__name__)
            elif result == UNKNOWN:
                lost.add(run_id)
            elif result == CLOSED or (type(op) is _Finish and result == 0):
                closed.add(run_id)
        for run_id, ops in batch.items():
            queue = self._runs.setdefault(run_id, _RunQueue())
            if run_id in lost and run_id not in closed:
                # NOTE: Redis came back empty: write the run back whole, then what followed
                log.warning("run restored into redis", run_id=run_id)
                self._pending[run_id] = [_Restore(), *self._pending.get(run_id, [])]
                queue.queued += 1
            queue.written += len(ops)
            self._release_waiters(run_id)
        for run_id in closed:
            self._pending.pop(run_id, None)
            self.on_closed(run_id)

    def _release_waiters(self, run_id: str | None = None) -> None:
        runs = [run_id] if run_id is not None else list(self._runs)
        for rid in runs:
            queue = self._runs.get(rid)
            if queue is None:
                continue
            waiting = []
            for target, done in queue.waiters:
                if run_id is None or queue.written >= target:
                    if not done.done():
                        done.set_result(None)
                else:
                    waiting.append((target, done))
            queue.waiters = waiting

    async def close(self, within: float = 2.0) -> None:
        """Shutdown: one last try to write what is queued, then what is left is lost."""
        await stop_tasks([self._task])
        if self._pending:
            batch, self._pending = self._pending, {}
            written = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within):
                    written = await self._write(batch)
            if not written:
                log.error("run writes lost at shutdown: redis is away", runs=len(batch))
        self._release_waiters()
