"""The run store interface: run records, their event logs, and the one terminal transition.

Two backends implement it: `store_memory` (one gateway process) and, for replicas sharing state,
a Redis backend. The store owns run state; the run driver and the HTTP handlers only ask.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from dataclasses import fields as dataclass_fields
from typing import Any, Protocol

import orjson

from gateway.runs.status import RunStatus


class UnknownRun(LookupError):
    """No such run (or not this tenant's: the same answer, design §4)."""


class ResumeWindowExpired(LookupError):
    """The events after the requested sequence number are no longer retained."""


class LogClosed(Exception):
    """The run has ended: its event log takes nothing more."""


class StoreUnavailable(Exception):
    """The shared store (Redis) cannot be reached or does not answer in time."""


# One event of a run's log as it goes out: (payload, text, index), its chunk JSON and, for a plain
# text delta, its text and choice (else None and 0), so the text of a client that fell behind can
# be merged (design §3) without the JSON being read back.
# NOTE: plain tuples, not objects: a replica keeps hundreds of thousands of them, and the garbage
# collector leaves tuples of bytes and str alone, where objects would make every full collection
# walk them all (measured: 12x the time of a full collection at 460,000 events).
Chunk = tuple[bytes, str | None, int]
# The same as kept and read back, numbered: (seq, payload, text, index), one tuple an event.
LogEvent = tuple[int, bytes, str | None, int]
LogEvents = list[LogEvent]  # in seq order
# A caught-up follower in this process that can take new events as they are appended, without
# waiting (its client's socket has room): True if it took them, False to be woken to read them.
Deliver = Callable[[LogEvents], bool]


def log_chunk(payload: bytes, text: str | None = None, index: int = 0) -> Chunk:
    """A log event: `text` and `index` only for a plain text delta."""
    return (payload, text, index)


@dataclass(slots=True, frozen=True)
class TerminalRecord:
    """How a run ended. `cause` separates e.g. the deadlines (`deadline:ttft`) or cancel sources
    (`cancel:client`, `cancel:disconnect`); `completion` is the final `chat.completion` object,
    kept as its JSON (compact, and sent as it is); `error` is the error the run ended with, in
    OpenAI's shape. `refused` says the upstream turned the run down before its first event, so
    the request that started it answers with that error as a plain HTTP answer, not a stream;
    `retry_after` is the upstream's, for a refusal a retry may cure. What HTTP status any of it
    is, is the gateway's business (gateway/http/errors.py), not the store's."""

    status: RunStatus
    cause: str
    finish_reason: str | None = None
    completion: bytes | None = None
    error: dict[str, Any] | None = None
    at: float = 0.0
    refused: bool = False
    retry_after: float | None = None

    def __post_init__(self) -> None:
        if not self.status.is_terminal:
            raise ValueError(f"{self.status.name} is not a terminal status")

    @property
    def size(self) -> int:
        """Roughly the bytes this record holds (what retention limits count)."""
        return 256 + len(self.completion or b"")

    def completion_object(self) -> dict[str, Any] | None:
        return None if self.completion is None else orjson.loads(self.completion)


def terminal_to_json(record: TerminalRecord) -> bytes:
    fields = {f.name: getattr(record, f.name) for f in dataclass_fields(record)}
    fields["status"] = int(record.status)
    if record.completion is not None:
        fields["completion"] = orjson.Fragment(record.completion)  # embedded as it is
    return orjson.dumps(fields)


def terminal_from_json(raw: bytes | str) -> TerminalRecord:
    data = orjson.loads(raw)
    completion = data.get("completion")
    if completion is not None:
        data["completion"] = orjson.dumps(completion)
    return TerminalRecord(**(data | {"status": RunStatus(data["status"])}))


@dataclass(slots=True)
class RunRecord:
    run_id: str
    tenant: str
    model: str
    created: float
    stream: bool = True
    status: RunStatus = RunStatus.RECEIVED
    terminal: TerminalRecord | None = None
    last_seq: int = 0
    owner: str = ""  # the gateway replica driving the run
    meta: dict[str, Any] = field(default_factory=dict)


class RunStore(Protocol):
    async def create(self, record: RunRecord) -> None:
        """Store a new run; its event log starts empty (seq 0)."""

    async def get(self, run_id: str) -> RunRecord:
        """The run's current record; raises UnknownRun."""

    async def advance(self, run_id: str, status: RunStatus) -> bool:
        """Move a live run forward to a non-terminal status; False if it cannot."""

    async def finish(
        self, run_id: str, terminal: TerminalRecord, final: Chunk | None = None
    ) -> bool:
        """The one terminal transition (compare-and-set): True for the first caller only, whose
        `final` event (if any) is appended to the log in the same step."""

    async def append(self, run_id: str, chunks: list[Chunk]) -> int:
        """Append events in order; returns the last sequence number given; raises LogClosed."""

    async def read(self, run_id: str, after: int, limit: int = 0) -> LogEvents:
        """Retained events with seq > after, in order (at most `limit`, 0 = all); raises
        ResumeWindowExpired."""

    async def wait(self, run_id: str, after: int, deliver: Deliver | None = None) -> int:
        """Return once an event with seq > after exists or the run ended (callers bound it with
        `asyncio.timeout` to check on the run's owner meanwhile). A store that appends in this
        process may hand new events to `deliver` as they are appended instead of waking the
        caller; returns the last seq `deliver` took (`after` when none)."""

    async def add_follower(self, run_id: str, delta: int) -> int:
        """Count one of this replica's followers in (+1) or out (-1); returns the followers
        known to be there now (at least this replica's own)."""

    def add_follower_now(self, run_id: str, delta: int) -> int | None:
        """`add_follower` where it needs no round trip (the run's log is in this process); None
        where it does, and nothing was counted: the caller awaits `add_follower`."""

    async def followers(self, run_id: str) -> int:
        """Every replica's followers of the run, as the store knows them now."""

    async def signal_cancel(self, run_id: str, source: str) -> None:
        """Ask the replica that drives the run to cancel it."""

    def cancel_signals(self) -> AsyncIterator[tuple[str, str]]:
        """(run id, source) of cancels asked of any replica, as they come."""

    async def keep_alive(self, owner: str, ttl: float) -> None:
        """Renew the lease that says replica `owner` is alive."""

    async def owner_alive(self, owner: str) -> bool:
        """Whether replica `owner` renewed its lease in time."""
