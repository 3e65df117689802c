"""The Redis run store with a local mirror of the runs this replica drives.

Other replicas resume and watch a run from Redis; the owner keeps the run in process memory as
well and treats that as the truth for it: its followers (nearly all of them: a stream is
usually read where it was started) read and wake without a round trip, and every change it makes
(events, status, the ending, its follower count) is applied to the mirror at once and reaches
Redis a few milliseconds later through the write-behind (`redis_writes`). So a Redis outage
does not touch a live run here: the writes wait and go out when Redis is back, and only an
outage past the grace ends the run (the run manager's doing, design §11).

The mirror holds the same seq numbers as Redis because the owner is the only writer of its runs'
logs. The exception is another replica ending a run whose owner it took for dead: the owner
learns it when a write is refused, and then drops its mirror of that run, so its followers go to
Redis for the rest, and its next append fails as on a closed log.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.runs.status import RunStatus
from gateway.state.redis_writes import WriteBehind
from gateway.state.run_store import (
    Chunk,
    Deliver,
    LogClosed,
    LogEvents,
    RunRecord,
    StoreUnavailable,
    TerminalRecord,
    UnknownRun,
)
from gateway.state.run_store_memory import MemoryRunStore
from gateway.state.run_store_redis import RedisRunStore
from gateway.state.store_health import StoreHealth

MIRROR_RETENTION = 30.0  # seconds an ended run stays mirrored (later resumes read Redis)


class MirroredRunStore:
    def __init__(
        self,
        shared: RedisRunStore,
        health: StoreHealth | None = None,
        local: MemoryRunStore | None = None,
    ) -> None:
        """`local` is the mirror (by default one keeping ended runs `MIRROR_RETENTION` s)."""
        self.shared = shared
        self.health = health or StoreHealth()
        retention = min(MIRROR_RETENTION, shared.retention)
        self.local = local or MemoryRunStore(shared.max_events, retention=retention)
        self.writes = WriteBehind(shared, self.health, self._snapshot, self._ended_elsewhere)
        self._refused: set[str] = set()  # runs whose writes Redis refused

    async def close(self) -> None:
        await self.writes.close()
        await self.shared.close()

    def _ended_elsewhere(self, run_id: str) -> None:
        self._refused.add(run_id)
        self.local.discard(run_id)  # the mirror lacks that ending: followers go to Redis

    def _snapshot(self, run_id: str) -> tuple[RunRecord, LogEvents, int] | None:
        if not self.local.has(run_id):
            return None
        record, events = self.local.snapshot(run_id)
        return record, events, self.local.followers_now(run_id)

    async def create(self, record: RunRecord) -> None:
        await self.shared.create(record)  # refused at once while Redis is away: a 503
        await self.adopt(record)

    async def adopt(self, record: RunRecord) -> None:
        """Mirror a run whose record Redis already has (written with its claim and admission,
        gateway/state/redis_open.py)."""
        await self.local.create(RunRecord(**{f: getattr(record, f) for f in _FIELDS}))

    async def get(self, run_id: str) -> RunRecord:
        if self.local.has(run_id):
            return await self.local.get(run_id)  # the owner's record is the truth
        return await self.shared.get(run_id)

    async def advance(self, run_id: str, status: RunStatus) -> bool:
        if not self.local.has(run_id):
            return await self.shared.advance(run_id, status)
        moved = await self.local.advance(run_id, status)
        if moved:
            self.writes.advance(run_id, status)
        return moved

    async def finish(
        self, run_id: str, terminal: TerminalRecord, final: Chunk | None = None
    ) -> bool:
        if not self.local.has(run_id):
            return await self.shared.finish(run_id, terminal, final)
        before = (await self.local.get(run_id)).last_seq
        if not await self.local.finish(run_id, terminal, final):
            return False
        self.writes.finish(run_id, terminal, final, before + 1 if final is not None else 0)
        # NOTE: this replica's followers heard of the ending from the mirror already; the
        # run's settlement (usage record, refund, run end line) waits until Redis has it too
        # (at most a write-behind tick with Redis up); with Redis away it waits in the queue.
        await self.writes.settle(run_id)
        self.writes.forget(run_id)
        return run_id not in self._refused

    async def append(self, run_id: str, chunks: list[Chunk]) -> int:
        if run_id in self._refused:
            raise LogClosed(run_id)
        if not self.local.has(run_id):  # not driven here (or no longer mirrored)
            return await self.shared.append(run_id, chunks)
        seq = await self.local.append(run_id, chunks)
        self.writes.append(run_id, seq - len(chunks) + 1, chunks)
        return seq

    async def read(self, run_id: str, after: int, limit: int = 0) -> LogEvents:
        if self.local.has(run_id):
            return await self.local.read(run_id, after, limit)
        return await self.shared.read(run_id, after, limit)

    async def wait(self, run_id: str, after: int, deliver: Deliver | None = None) -> int:
        if self.local.has(run_id):
            try:
                after = await self.local.wait(run_id, after, deliver)
            except UnknownRun:
                pass  # dropped while waiting: fall through to Redis
            else:
                if self.local.has(run_id):
                    return after
        return await self.shared.wait(run_id, after)

    async def add_follower(self, run_id: str, delta: int) -> int:
        count = self.add_follower_now(run_id, delta)
        return await self.shared.add_follower(run_id, delta) if count is None else count

    def add_follower_now(self, run_id: str, delta: int) -> int | None:
        if not self.local.has(run_id):
            return None
        count = self.local.add_follower_now(run_id, delta)
        self.shared.count_locally(run_id, count)
        self.writes.followers(run_id, count)
        return count

    async def followers(self, run_id: str) -> int:
        """Every replica's followers: Redis's sum once this replica's count is there. While
        Redis is away, this replica's own if it has any; none here is not none anywhere (a
        follower that came to another replica before Redis went away still reads), so that
        answer waits for Redis: StoreUnavailable."""
        if self.local.has(run_id) and not await self.writes.settle(run_id):
            if here := self.local.followers_now(run_id):
                return here
            raise StoreUnavailable("followers on other replicas are unknown while redis is away")
        return await self.shared.followers(run_id)

    async def signal_cancel(self, run_id: str, source: str) -> None:
        await self.shared.signal_cancel(run_id, source)

    def cancel_signals(self) -> AsyncIterator[tuple[str, str]]:
        return self.shared.cancel_signals()

    async def keep_alive(self, owner: str, ttl: float) -> None:
        await self.shared.keep_alive(owner, ttl)

    async def owner_alive(self, owner: str) -> bool:
        return await self.shared.owner_alive(owner)


_FIELDS = ("run_id", "tenant", "model", "created", "stream", "status", "owner", "meta")
