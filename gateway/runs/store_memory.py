"""The in-process run store: a bounded ring of events per run plus the terminal record.

Everything happens on the gateway's event loop, so a plain check-then-set is atomic here; the
Redis backend does the same transitions with scripts.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from gateway.runs.state import RunStatus, can_advance
from gateway.runs.store import ResumeWindowExpired, RunRecord, TerminalRecord, UnknownRun


@dataclass(slots=True)
class _Entry:
    record: RunRecord
    events: deque[tuple[int, bytes]]
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    ended_at: float | None = None


class MemoryRunStore:
    """Keeps the last `max_events` events of each run, and ended runs for `retention` seconds."""

    def __init__(self, max_events: int = 4096, retention: float = 3600.0) -> None:
        self.max_events = max_events
        self.retention = retention
        self._runs: dict[str, _Entry] = {}

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

    async def finish(self, run_id: str, terminal: TerminalRecord) -> bool:
        entry = self._entry(run_id)
        if entry.record.status.is_terminal:
            return False
        entry.record.status = terminal.status
        entry.record.terminal = terminal
        entry.ended_at = time.monotonic()
        self._notify(entry)
        return True

    async def append(self, run_id: str, payloads: list[bytes]) -> int:
        entry = self._entry(run_id)
        if entry.record.status.is_terminal:
            raise ValueError(f"run {run_id} has ended; its log is closed")
        seq = entry.record.last_seq
        for payload in payloads:
            seq += 1
            entry.events.append((seq, payload))
        entry.record.last_seq = seq
        if payloads:
            self._notify(entry)
        return seq

    async def read(self, run_id: str, after: int) -> list[tuple[int, bytes]]:
        entry = self._entry(run_id)
        events = entry.events
        if after < entry.record.last_seq and (not events or events[0][0] > after + 1):
            raise ResumeWindowExpired(run_id)
        if not events or after >= events[-1][0]:
            return []
        start = max(0, after + 1 - events[0][0])
        return [events[i] for i in range(start, len(events))]

    async def wait(self, run_id: str, after: int) -> None:
        entry = self._entry(run_id)
        while not (entry.record.last_seq > after or entry.record.status.is_terminal):
            await entry.changed.wait()

    def _expire(self) -> None:
        """Forget runs that ended more than `retention` seconds ago."""
        cutoff = time.monotonic() - self.retention
        for run_id in [r for r, e in self._runs.items() if e.ended_at and e.ended_at < cutoff]:
            del self._runs[run_id]
