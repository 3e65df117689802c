"""The in-process run store: a bounded ring of events per run plus the terminal record.

Everything happens on the gateway's event loop, so a plain check-then-set is atomic here; the
Redis backend does the same transitions with scripts. There is one replica, so it is always
alive and cancels never need to travel.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.runs.state import RunStatus, can_advance
from gateway.runs.store import (
    LogClosed,
    ResumeWindowExpired,
    RunRecord,
    TerminalRecord,
    UnknownRun,
)


@dataclass(slots=True)
class _Entry:
    record: RunRecord
    events: deque[tuple[int, bytes]]
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    followers: int = 0


class MemoryRunStore:
    """Keeps the last `max_events` events of each run; ended runs stay `retention` seconds, and
    at most `max_ended_runs` of them (the oldest go first), so memory stays bounded."""

    def __init__(
        self, max_events: int = 4096, retention: float = 600.0, max_ended_runs: int = 10_000
    ) -> None:
        self.max_events = max_events
        self.retention = retention
        self.max_ended_runs = max_ended_runs
        self._runs: dict[str, _Entry] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()  # run id → when it ended

    def _entry(self, run_id: str) -> _Entry:
        entry = self._runs.get(run_id)
        if entry is None:
            raise UnknownRun(run_id)
        return entry

    def _notify(self, entry: _Entry) -> None:
        entry.changed.set()
        entry.changed = asyncio.Event()

    async def create(self, record: RunRecord) -> None:
        self._expire()
        if record.run_id in self._runs:
            raise ValueError(f"run {record.run_id} exists")
        self._runs[record.run_id] = _Entry(record, deque(maxlen=self.max_events))

    async def get(self, run_id: str) -> RunRecord:
        return self._entry(run_id).record

    async def advance(self, run_id: str, status: RunStatus) -> bool:
        record = self._entry(run_id).record
        if status.is_terminal or not can_advance(record.status, status):
            return False
        record.status = status
        return True

    async def finish(
        self, run_id: str, terminal: TerminalRecord, final: bytes | None = None
    ) -> bool:
        entry = self._entry(run_id)
        if entry.record.status.is_terminal:
            return False
        if final is not None:
            self._append(entry, [final])
        entry.record.status = terminal.status
        entry.record.terminal = terminal
        self._ended[run_id] = time.monotonic()
        self._notify(entry)
        return True

    async def append(self, run_id: str, payloads: list[bytes]) -> int:
        entry = self._entry(run_id)
        if entry.record.status.is_terminal:
            raise LogClosed(run_id)
        seq = self._append(entry, payloads)
        if payloads:
            self._notify(entry)
        return seq

    def _append(self, entry: _Entry, payloads: list[bytes]) -> int:
        seq = entry.record.last_seq
        for payload in payloads:
            seq += 1
            entry.events.append((seq, payload))
        entry.record.last_seq = seq
        return seq

    async def read(self, run_id: str, after: int, limit: int = 0) -> list[tuple[int, bytes]]:
        entry = self._entry(run_id)
        events = entry.events
        if after < entry.record.last_seq and (not events or events[0][0] > after + 1):
            raise ResumeWindowExpired(run_id)
        if not events or after >= events[-1][0]:
            return []
        start = max(0, after + 1 - events[0][0])
        stop = len(events) if limit <= 0 else min(len(events), start + limit)
        return [events[i] for i in range(start, stop)]

    async def wait(self, run_id: str, after: int) -> None:
        entry = self._entry(run_id)
        while not (entry.record.last_seq > after or entry.record.status.is_terminal):
            await entry.changed.wait()
            if self._runs.get(run_id) is not entry:
                raise UnknownRun(run_id)  # discarded while waiting

    def has(self, run_id: str) -> bool:
        return run_id in self._runs

    def discard(self, run_id: str) -> None:
        """Forget a run now; its waiters wake and find it unknown."""
        entry = self._runs.pop(run_id, None)
        self._ended.pop(run_id, None)
        if entry is not None:
            self._notify(entry)

    async def add_follower(self, run_id: str, delta: int) -> int:
        entry = self._entry(run_id)
        entry.followers = max(0, entry.followers + delta)
        return entry.followers

    async def followers(self, run_id: str) -> int:
        return self._entry(run_id).followers

    def followers_now(self, run_id: str) -> int:
        entry = self._runs.get(run_id)
        return entry.followers if entry is not None else 0

    def snapshot(self, run_id: str) -> tuple[RunRecord, list[tuple[int, bytes]]]:
        """The run's record and the events it keeps, as they are now."""
        entry = self._entry(run_id)
        return entry.record, list(entry.events)

    async def signal_cancel(self, run_id: str, source: str) -> None:
        return None  # one replica: the run manager cancels its own runs directly

    async def cancel_signals(self) -> AsyncIterator[tuple[str, str]]:
        await asyncio.Event().wait()  # no other replica ever asks
        yield "", ""  # pragma: no cover - unreachable, makes this an async generator

    async def keep_alive(self, owner: str, ttl: float) -> None:
        return None

    async def owner_alive(self, owner: str) -> bool:
        return True

    def _expire(self) -> None:
        """Forget runs that ended more than `retention` seconds ago, or past the count cap."""
        cutoff = time.monotonic() - self.retention
        ended = self._ended
        while ended and (len(ended) > self.max_ended_runs or next(iter(ended.values())) < cutoff):
            run_id, _ = ended.popitem(last=False)
            self._runs.pop(run_id, None)
