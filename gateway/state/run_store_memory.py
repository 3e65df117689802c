"""The in-process run store: a bounded ring of events per run plus the terminal record.

Everything happens on the gateway's event loop, so a plain check-then-set is atomic here; the
Redis backend does the same transitions with scripts. There is one replica, so it is always
alive and cancels never need to travel.

Memory is bounded by bytes, not only by counts and age: a run keeps at most `max_event_bytes`
of events (older ones are dropped, so a resume from before them is a 410), and ended runs
together hold at most `retention_bytes` (the oldest ended runs go first). A live run's events are
a deque of tuples (cheap to append to); once it has ended and its last follower has left, they
are packed into a `CompactLog`, one compressed buffer, so thousands of retained runs cost few
bytes and almost no objects.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.runs.status import RunStatus, can_advance
from gateway.state.compact_log import CompactLog
from gateway.state.run_store import (
    Chunk,
    Deliver,
    LogClosed,
    LogEvent,
    LogEvents,
    ResumeWindowExpired,
    RunRecord,
    TerminalRecord,
    UnknownRun,
)

EVENT_OVERHEAD = 120  # bytes a live event costs beyond its payload (tuple, int, chunk, bytes)


class _Waiter:
    """A follower waiting for events after `after`; one with `deliver` takes them as they come
    for as long as it can (its position moves on), and is woken only when it cannot."""

    __slots__ = ("after", "deliver", "woken")

    def __init__(self, after: int, deliver: Deliver | None) -> None:
        self.after = after
        self.deliver = deliver
        self.woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def offer(self, fresh: LogEvents) -> bool:
        """Hand the events just appended to `deliver`: True if it took them."""
        if self.deliver is None or self.after != fresh[0][0] - 1:
            return False
        try:
            took = self.deliver(fresh)
        except Exception:  # NOTE: the appending driver must never fail for a follower's sake
            return False
        if took:
            self.after = fresh[-1][0]
        return took


@dataclass(slots=True)
class _Entry:
    record: RunRecord
    events: deque[LogEvent] | CompactLog = field(default_factory=deque)  # packed once ended, unread
    # NOTE: one waiter per waiting follower, woken and dropped by the next change (or kept, if
    # it took the change itself): an append nobody waits for costs nothing, and a wake-up is one
    # `set_result` (an Event made and dropped per append cost an object, its deque and a future
    # on every chunk).
    waiters: list[_Waiter] | None = None
    followers: int = 0
    event_bytes: int = 0

    @property
    def size(self) -> int:
        terminal = self.record.terminal
        return self.event_bytes + (terminal.size if terminal is not None else 0)


class MemoryRunStore:
    """Keeps the last `max_events` events of each run, and no more than `max_event_bytes` of
    them; ended runs stay `retention` seconds, at most `max_ended_runs` of them and at most
    `retention_bytes` together (the oldest go first), so memory stays bounded."""

    def __init__(
        self,
        max_events: int = 4096,
        retention: float = 600.0,
        max_ended_runs: int = 10_000,
        *,
        max_event_bytes: int = 8 << 20,
        retention_bytes: int = 256 << 20,
    ) -> None:
        self.max_events = max_events
        self.retention = retention
        self.max_ended_runs = max_ended_runs
        self.max_event_bytes = max_event_bytes
        self.retention_bytes = retention_bytes
        self._runs: dict[str, _Entry] = {}
        self._ended: OrderedDict[str, float] = OrderedDict()  # run id → when it ended
        self.ended_bytes = 0  # what the ended runs kept here hold

    def _entry(self, run_id: str) -> _Entry:
        entry = self._runs.get(run_id)
        if entry is None:
            raise UnknownRun(run_id)
        return entry

    def _notify(self, entry: _Entry, fresh: LogEvents | None = None) -> None:
        """Wake the run's waiters, except those that took the `fresh` events themselves."""
        waiters = entry.waiters
        if waiters is None:
            return
        entry.waiters = None
        for waiter in waiters:
            if waiter.woken.done():
                continue
            if fresh and waiter.offer(fresh):
                if entry.waiters is None:
                    entry.waiters = [waiter]
                else:
                    entry.waiters.append(waiter)
            else:
                waiter.woken.set_result(None)

    async def create(self, record: RunRecord) -> None:
        self._expire()
        if record.run_id in self._runs:
            raise ValueError(f"run {record.run_id} exists")
        self._runs[record.run_id] = _Entry(record)

    async def get(self, run_id: str) -> RunRecord:
        return self._entry(run_id).record

    async def advance(self, run_id: str, status: RunStatus) -> bool:
        record = self._entry(run_id).record
        if status.is_terminal or not can_advance(record.status, status):
            return False
        record.status = status
        return True

    async def finish(
        self, run_id: str, terminal: TerminalRecord, final: Chunk | None = None
    ) -> bool:
        entry = self._entry(run_id)
        if entry.record.status.is_terminal:
            return False
        if final is not None:
            self._append(entry, [final])
        entry.record.status = terminal.status
        entry.record.terminal = terminal
        self._ended[run_id] = time.monotonic()
        self.ended_bytes += entry.size
        if not entry.followers:
            self._pack(entry)
        self._notify(entry)
        self._expire()
        return True

    async def append(self, run_id: str, chunks: list[Chunk]) -> int:
        entry = self._runs.get(run_id)  # NOTE: `_entry` and `is_terminal` inline: every chunk
        if entry is None:
            raise UnknownRun(run_id)
        if entry.record.status >= RunStatus.COMPLETED:
            raise LogClosed(run_id)
        before = entry.record.last_seq
        seq = self._append(entry, chunks)
        if chunks and entry.waiters is not None:
            # NOTE: the appended events are the log's last ones (none is trimmed: the newest
            # always stay), read from its end only when somebody waits to take them
            events = entry.events
            fresh = min(seq - before, len(events))
            if fresh == 1:  # a live run's usual append
                self._notify(entry, [events[-1]])
            else:
                self._notify(entry, [events[i] for i in range(-fresh, 0)])
        return seq

    def _pack(self, entry: _Entry) -> None:
        """The run has ended (it counts among the ended runs' bytes) and nobody reads it now:
        its log takes nothing more, so keep it packed from now on. NOTE: the run's own streams
        read its last events right after the ending; packing waits for them, or each would
        unpack the log just packed."""
        if not isinstance(entry.events, deque):
            return
        packed = CompactLog.pack(entry.events)
        self.ended_bytes += packed.size - entry.event_bytes
        entry.events = packed
        entry.event_bytes = packed.size

    def _append(self, entry: _Entry, chunks: list[Chunk]) -> int:
        seq = entry.record.last_seq
        events = entry.events
        assert isinstance(events, deque), "an ended run's log takes no events"
        for payload, text, index in chunks:
            seq += 1
            events.append((seq, payload, text, index))
            entry.event_bytes += len(payload) + EVENT_OVERHEAD
        # NOTE: the newest event always stays (it may be the run's final error frame).
        while len(events) > 1 and (
            len(events) > self.max_events or entry.event_bytes > self.max_event_bytes
        ):
            entry.event_bytes -= len(events.popleft()[1]) + EVENT_OVERHEAD
        entry.record.last_seq = seq
        return seq

    async def read(self, run_id: str, after: int, limit: int = 0) -> LogEvents:
        entry = self._entry(run_id)
        events = entry.events
        count = len(events)
        if isinstance(events, CompactLog):
            first = events.first_seq
        else:
            first = events[0][0] if events else 0
        if after < entry.record.last_seq and (not count or first > after + 1):
            raise ResumeWindowExpired(run_id)
        if not count or after >= first + count - 1:  # NOTE: the kept seq numbers are consecutive
            return []
        start = max(0, after + 1 - first)
        stop = count if limit <= 0 else min(count, start + limit)
        if isinstance(events, CompactLog):
            return events.slice(start, stop)
        return [events[i] for i in range(start, stop)]

    async def wait(self, run_id: str, after: int, deliver: Deliver | None = None) -> int:
        entry = self._entry(run_id)
        while not (entry.record.last_seq > after or entry.record.status.is_terminal):
            waiter = _Waiter(after, deliver)
            if entry.waiters is None:
                entry.waiters = [waiter]
            else:
                entry.waiters.append(waiter)
            try:
                await waiter.woken
            except asyncio.CancelledError:  # a bounded wait ran out: leave no waiter behind
                if entry.waiters is not None and waiter in entry.waiters:
                    entry.waiters.remove(waiter)
                raise
            if self._runs.get(run_id) is not entry:  # discarded while waiting
                if waiter.after == after:
                    raise UnknownRun(run_id)
                return waiter.after  # what it took stands; its next read finds the run gone
            after = waiter.after
        return after

    def has(self, run_id: str) -> bool:
        return run_id in self._runs

    def discard(self, run_id: str) -> None:
        """Forget a run now; its waiters wake and find it unknown."""
        entry = self._runs.pop(run_id, None)
        if self._ended.pop(run_id, None) is not None and entry is not None:
            self.ended_bytes -= entry.size
        if entry is not None:
            self._notify(entry)

    def bytes_held(self) -> int:
        """Bytes the runs kept here hold, live and ended."""
        return sum(entry.size for entry in self._runs.values())

    async def add_follower(self, run_id: str, delta: int) -> int:
        return self.add_follower_now(run_id, delta)

    def add_follower_now(self, run_id: str, delta: int) -> int:
        entry = self._entry(run_id)
        entry.followers = max(0, entry.followers + delta)
        if not entry.followers and entry.record.status.is_terminal:
            self._pack(entry)  # its last reader has left
        return entry.followers

    async def followers(self, run_id: str) -> int:
        return self._entry(run_id).followers

    def followers_now(self, run_id: str) -> int:
        entry = self._runs.get(run_id)
        return entry.followers if entry is not None else 0

    def snapshot(self, run_id: str) -> tuple[RunRecord, LogEvents]:
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
        """Forget runs that ended more than `retention` seconds ago, or past the caps on their
        count and bytes (the oldest first)."""
        cutoff = time.monotonic() - self.retention
        count, held = len(self._ended), self.ended_bytes
        gone = []
        for run_id, ended_at in self._ended.items():
            if count <= self.max_ended_runs and held <= self.retention_bytes and ended_at >= cutoff:
                break
            entry = self._runs.get(run_id)
            if entry is not None and entry.followers:
                continue  # NOTE: a client still reading its last events keeps it (in its place)
            gone.append(run_id)
            count -= 1
            held -= entry.size if entry is not None else 0
        for run_id in gone:
            del self._ended[run_id]
            entry = self._runs.pop(run_id, None)
            if entry is not None:
                self.ended_bytes -= entry.size
