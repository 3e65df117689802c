"""The Redis run store with a local mirror of the runs this replica drives.

Every event of a run is written to Redis (other replicas resume and watch from there), and the
owner keeps the same events in process memory as well, so its own followers — nearly all of
them: a stream is usually read where it was started — read and wake without a round trip. A
follower on another replica, or of a run this replica does not drive, reads Redis.

The mirror holds the same seq numbers as Redis because the owner is the only writer of its runs'
logs; the owner's appends reach Redis a few milliseconds later, in batches (`redis_appends`).
The exception is another replica ending a run whose owner it took for dead: the owner learns it
when a write is refused, and then drops its mirror of that run, so its followers go to Redis for
the rest, and its next append fails as on a closed log.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from gateway.runs.redis_appends import AppendBuffer
from gateway.runs.state import RunStatus
from gateway.runs.store import LogClosed, RunRecord, TerminalRecord, UnknownRun
from gateway.runs.store_memory import MemoryRunStore
from gateway.runs.store_redis import RedisRunStore

MIRROR_RETENTION = 30.0  # seconds an ended run stays mirrored (later resumes read Redis)


class MirroredRunStore:
    def __init__(self, shared: RedisRunStore) -> None:
        self.shared = shared
        retention = min(MIRROR_RETENTION, shared.retention)
        self.local = MemoryRunStore(shared.max_events, retention=retention)
        self.appends = AppendBuffer(shared, self._ended_elsewhere)
        self._refused: set[str] = set()  # runs whose events Redis refused

    async def close(self) -> None:
        await self.appends.close()
        await self.shared.close()

    def _ended_elsewhere(self, run_id: str) -> None:
        self._refused.add(run_id)
        self.local.discard(run_id)  # the mirror lacks that ending: followers go to Redis

    async def create(self, record: RunRecord) -> None:
        await self.shared.create(record)
        await self.local.create(RunRecord(**{f: getattr(record, f) for f in _FIELDS}))

    async def get(self, run_id: str) -> RunRecord:
        if self.local.has(run_id):
            record = await self.local.get(run_id)
            if record.status.is_terminal:  # a terminal record never changes: no trip to Redis
                return record
        return await self.shared.get(run_id)  # the truth, for status and the owner lease

    async def advance(self, run_id: str, status: RunStatus) -> bool:
        moved = await self.shared.advance(run_id, status)
        if moved and self.local.has(run_id):
            await self.local.advance(run_id, status)
        return moved

    async def finish(
        self, run_id: str, terminal: TerminalRecord, final: bytes | None = None
    ) -> bool:
        await self.appends.settle(run_id)  # the final event's seq follows every earlier one
        won = await self.shared.finish(run_id, terminal, final)
        self._refused.discard(run_id)
        if not self.local.has(run_id):
            return won
        if won:
            await self.local.finish(run_id, terminal, final)
        else:
            self.local.discard(run_id)  # ended elsewhere: the mirror lacks that ending
        return won

    async def append(self, run_id: str, payloads: list[bytes]) -> int:
        if run_id in self._refused:
            raise LogClosed(run_id)
        if not self.local.has(run_id):  # not driven here (or no longer mirrored)
            return await self.shared.append(run_id, payloads)
        seq = await self.local.append(run_id, payloads)
        self.appends.add(run_id, payloads)
        return seq

    async def read(self, run_id: str, after: int, limit: int = 0) -> list[tuple[int, bytes]]:
        if self.local.has(run_id):
            return await self.local.read(run_id, after, limit)
        return await self.shared.read(run_id, after, limit)

    async def wait(self, run_id: str, after: int) -> None:
        if self.local.has(run_id):
            try:
                await self.local.wait(run_id, after)
            except UnknownRun:
                pass  # dropped while waiting: fall through to Redis
            else:
                if self.local.has(run_id):
                    return
        await self.shared.wait(run_id, after)

    async def add_follower(self, run_id: str, delta: int) -> int:
        return await self.shared.add_follower(run_id, delta)

    async def signal_cancel(self, run_id: str, source: str) -> None:
        await self.shared.signal_cancel(run_id, source)

    def cancel_signals(self) -> AsyncIterator[tuple[str, str]]:
        return self.shared.cancel_signals()

    async def keep_alive(self, owner: str, ttl: float) -> None:
        await self.shared.keep_alive(owner, ttl)

    async def owner_alive(self, owner: str) -> bool:
        return await self.shared.owner_alive(owner)


_FIELDS = ("run_id", "tenant", "model", "created", "stream", "status", "owner", "meta")
