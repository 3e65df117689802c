"""The audit log: one append-only record per change of tenants or keys, never a key or a hash.

File mode: JSON lines in a file next to the tenants file (`tenants.audit.jsonl` beside
`tenants.toml`). Redis mode: the Redis Stream `{prefix}audit`, never trimmed. Both answer
`read(since)` in append order; `sluice audit` and `GET /admin/audit` read the same store.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import orjson
from redis.asyncio import Redis

ACTIONS = (
    "tenant.create",
    "tenant.update",
    "tenant.delete",
    "key.create",
    "key.revoke",
    "tenants.push",  # `sluice tenants push`: the whole file stored in Redis
)


@dataclass(slots=True, frozen=True)
class AuditRecord:
    """Who changed what, and the changed fields before and after."""

    who: str  # "admin:key_…" (an admin key's short hash), "jwt:<sub>" or "cli:<user>"
    action: str  # one of ACTIONS
    target: str  # the tenant's name, or the key's id
    tenant: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        at = datetime.fromtimestamp(self.ts, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        return {"at": at, **asdict(self)}

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_json(cls, raw: bytes | str) -> AuditRecord:
        d = orjson.loads(raw)
        d.pop("at", None)
        return cls(**d)


class AuditLog(Protocol):
    async def append(self, record: AuditRecord) -> None: ...

    async def read(self, since: float | None = None) -> list[AuditRecord]:
        """Records at or after `since` (Unix time), oldest first."""
        ...


def audit_path(tenants_file: str | Path) -> Path:
    """The audit file of a tenants file: `tenants.toml` → `tenants.audit.jsonl`, beside it."""
    return Path(tenants_file).with_suffix(".audit.jsonl")


class FileAuditLog:
    """JSON lines; each record is one write to a file opened with O_APPEND, so the gateway and
    the CLI appending at once never interleave within a line."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    async def append(self, record: AuditRecord) -> None:
        await asyncio.to_thread(self._append, record.to_json() + b"\n")

    def _append(self, line: bytes) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)

    async def read(self, since: float | None = None) -> list[AuditRecord]:
        try:
            data = await asyncio.to_thread(self.path.read_bytes)
        except FileNotFoundError:
            return []
        records = []
        for line in data.splitlines(keepends=True):
            if not line.endswith(b"\n"):
                break  # a torn last line: a crash mid-write
            record = AuditRecord.from_json(line)
            if since is None or record.ts >= since:
                records.append(record)
        return records


class RedisAuditLog:
    """The Redis Stream `{prefix}audit`; entries are never trimmed (the log is append-only)."""

    def __init__(self, redis: Redis, prefix: str) -> None:
        self.redis = redis  # owned by the caller
        self.key = f"{prefix}audit"

    async def append(self, record: AuditRecord) -> None:
        await self.redis.xadd(self.key, {"r": record.to_json()})

    async def read(self, since: float | None = None) -> list[AuditRecord]:
        start = "-" if since is None else str(max(0, int(since * 1000) - 60_000))
        records = []
        for _, fields in await self.redis.xrange(self.key, min=start, max="+"):
            record = AuditRecord.from_json(fields[b"r"])
            if since is None or record.ts >= since:
                records.append(record)
        return records
