"""The usage ledger: one record per run at its terminal state, what billing and `sluice usage`
read. A JSON-lines file serves one host; a Redis Stream serves replicas sharing Redis.

Records are appended once, after the run is settled (see gateway/runs/accounting.py), and never
changed. `generated_tokens` is what the worker produced, tail included: that is what is billed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson
import structlog
from redis.asyncio import Redis

from gateway.state.redis_client import REDIS_ERRORS
from gateway.state.run_store import StoreUnavailable

log = structlog.get_logger("sluice.ledger")

STATUSES = ("completed", "cancelled", "timed_out", "failed")


@dataclass(slots=True, frozen=True)
class UsageRecord:
    run_id: str
    tenant: str
    principal: str  # the API key id ("key_…") or the JWT subject ("jwt:<sub>")
    model: str
    status: str  # completed | cancelled | timed_out | failed
    finish_reason: str | None
    cancel_source: str | None
    prompt_tokens: int
    generated_tokens: int  # what the worker generated, tail included: what is billed
    sent_tokens: int
    tail_tokens: int
    ttft_s: float | None
    e2e_s: float
    ended_at: float  # Unix time
    # prompt_tokens and generated_tokens at the model's [prices] (gateway/prices.py), in the
    # prices' currency; None when the model has no price
    cost: float | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"usage status {self.status!r} is not one of {', '.join(STATUSES)}")

    def to_json(self) -> bytes:
        return orjson.dumps(self)  # orjson writes a dataclass's fields itself, 10x asdict

    @classmethod
    def from_json(cls, raw: bytes | str) -> UsageRecord:
        """A record from its JSON; fields a newer writer added are ignored, so old readers
        keep working on a ledger that newer gateways append to."""
        d = orjson.loads(raw)
        return cls(**{name: d[name] for name in _FIELDS if name in d or name in _REQUIRED})


_FIELDS = tuple(f.name for f in dataclasses.fields(UsageRecord))
# NOTE: fields with a default were added later: a record written before them reads as the default
_REQUIRED = frozenset(
    f.name for f in dataclasses.fields(UsageRecord) if f.default is dataclasses.MISSING
)


class UsageLedger(Protocol):
    async def append(self, record: UsageRecord) -> None: ...

    def read(
        self, since: float | None = None, tenant: str | None = None
    ) -> AsyncIterator[UsageRecord]:
        """Records with ended_at >= since (Unix time) for the tenant, in append order."""
        ...

    async def close(self) -> None: ...


def _wanted(record: UsageRecord, since: float | None, tenant: str | None) -> bool:
    return (since is None or record.ended_at >= since) and (
        tenant is None or record.tenant == tenant
    )


def default_usage_file(redis: bool = False) -> Path:
    """Where the JSONL ledger lives unless told otherwise: the user's state folder. With Redis
    the file only holds what was written while Redis was away, under its own name."""
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "sluicegate" / ("usage-fallback.jsonl" if redis else "usage.jsonl")


class JsonlLedger:
    """One JSON line per record, appended to a file.

    NOTE: each record is one unbuffered write of one line to a file opened with O_APPEND, done
    on the event loop. Without fsync that is a copy into the page cache (microseconds for a
    ~400-byte line), cheaper than a hop to a thread, and it keeps appends in call order. One
    write() per line also means several processes appending to the same local file never
    interleave within a line. A crash can lose the last records or leave the last line torn;
    `read` skips a torn last line.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: Any = None

    async def append(self, record: UsageRecord) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "ab", buffering=0)  # noqa: ASYNC230, SIM115 (see NOTE)
        line = memoryview(record.to_json() + b"\n")
        while line:
            line = line[self._file.write(line) :]

    async def read(
        self, since: float | None = None, tenant: str | None = None
    ) -> AsyncIterator[UsageRecord]:
        try:
            f = await asyncio.to_thread(open, self.path, "rb")
        except FileNotFoundError:
            return
        try:
            number = 0
            while lines := await asyncio.to_thread(f.readlines, 1 << 16):
                for line in lines:
                    number += 1
                    if not line.endswith(b"\n"):
                        break  # the last line, torn by a crash or still being written
                    try:
                        record = UsageRecord.from_json(line)
                    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                        raise ValueError(
                            f"{self.path}:{number}: not a usage record: {exc}"
                        ) from exc
                    if _wanted(record, since, tenant):
                        yield record
        finally:
            f.close()

    async def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class RedisLedger:
    """Records in one Redis Stream, `{prefix}usage`, trimmed to about `maxlen` entries.

    Entry ids are Redis's clock at append time, which is at or after the run's end. A read
    starts `CLOCK_SKEW` seconds before `since`, so a gateway clock ahead of Redis's loses
    nothing, and then filters on each record's own `ended_at`.

    A record that cannot reach Redis (it is away) goes to the `fallback` JSONL ledger on this
    host instead, so no run goes unbilled; `read` returns those too. Each run is read once, also
    when a resent append left its record in the stream twice.
    """

    CLOCK_SKEW = 60.0
    PAGE = 1000

    def __init__(
        self,
        redis: Redis,
        prefix: str = "sluice:",
        maxlen: int = 1_000_000,
        fallback: JsonlLedger | None = None,
    ) -> None:
        self.redis = redis  # owned by the caller, who closes it
        self.key = f"{prefix}usage"
        self.maxlen = maxlen
        self.fallback = fallback

    async def append(self, record: UsageRecord) -> None:
        try:
            await self.redis.xadd(
                self.key, {"r": record.to_json()}, maxlen=self.maxlen, approximate=True
            )
        except (StoreUnavailable, *REDIS_ERRORS) as exc:
            if self.fallback is None:
                raise
            await self.fallback.append(record)
            log.warning(
                "usage record kept in the fallback file: redis is away",
                run_id=record.run_id,
                path=str(self.fallback.path),
                error=type(exc).__name__,
            )

    async def read(
        self, since: float | None = None, tenant: str | None = None
    ) -> AsyncIterator[UsageRecord]:
        seen: set[str] = set()
        start = "-" if since is None else str(max(0, int((since - self.CLOCK_SKEW) * 1000)))
        while entries := await self.redis.xrange(self.key, min=start, max="+", count=self.PAGE):
            for _, fields in entries:
                record = UsageRecord.from_json(fields[b"r"])
                # NOTE: the client resends an XADD whose reply was lost, and the stream may then
                # hold the record twice: each run is read once
                if record.run_id not in seen and _wanted(record, since, tenant):
                    seen.add(record.run_id)
                    yield record
            start = "(" + entries[-1][0].decode()
        if self.fallback is not None:
            async for record in self.fallback.read(since, tenant):
                if record.run_id not in seen:
                    yield record

    async def close(self) -> None:
        if self.fallback is not None:
            await self.fallback.close()


def totals(records: Iterable[UsageRecord]) -> list[dict]:
    """Sums per (tenant, model), sorted by both: runs, runs per status, and tokens."""
    rows: dict[tuple[str, str], dict] = {}
    for r in records:
        row = rows.get((r.tenant, r.model))
        if row is None:
            row = rows[(r.tenant, r.model)] = {
                "tenant": r.tenant,
                "model": r.model,
                "runs": 0,
                **dict.fromkeys(STATUSES, 0),
                "prompt": 0,
                "generated": 0,
                "sent": 0,
                "tail": 0,
            }
        row["runs"] += 1
        row[r.status] += 1
        row["prompt"] += r.prompt_tokens
        row["generated"] += r.generated_tokens
        row["sent"] += r.sent_tokens
        row["tail"] += r.tail_tokens
    return [rows[k] for k in sorted(rows)]
