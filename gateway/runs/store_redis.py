"""The Redis run store, shared by gateway replicas: a hash per run, a Redis Stream per event log.

Transitions run as Lua scripts, so "append only while live" and "the one terminal transition" hold
across replicas without read-modify-write races. Followers learn of new events from a pub/sub
channel per run, cancels travel on one channel for all replicas, and each replica keeps a lease
key alive so others can tell a run whose owner died. Ended runs expire after `retention`
seconds; a log keeps at most `max_events` entries.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from redis.asyncio import Redis

from gateway.runs.redis_notify import Notifier
from gateway.runs.state import RunStatus
from gateway.runs.store import (
    LogClosed,
    ResumeWindowExpired,
    RunRecord,
    TerminalRecord,
    UnknownRun,
    terminal_from_json,
    terminal_to_json,
)

TERMINAL = int(RunStatus.COMPLETED)
_POLL = 0.5  # seconds between re-reads while waiting (a missed publish costs at most this)
_ENDED = float("inf")  # a finished run: every `after` is behind it

# KEYS: run hash, events stream, notify channel; ARGV: max_events, payload...
_APPEND = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if tonumber(status) >= TERMINAL then return -2 end
local seq = tonumber(redis.call('HGET', KEYS[1], 'last_seq'))
for i = 2, #ARGV do
  seq = seq + 1
  redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[1], seq .. '-0', 'd', ARGV[i])
end
redis.call('HSET', KEYS[1], 'last_seq', seq)
redis.call('PUBLISH', KEYS[3], seq)
return seq
""".replace("TERMINAL", str(TERMINAL))

# KEYS: run hash, events stream, notify channel
# ARGV: status, terminal json, retention ms, max_events[, final payload]
_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if tonumber(status) >= TERMINAL then return 0 end
if #ARGV >= 5 then
  local seq = tonumber(redis.call('HGET', KEYS[1], 'last_seq')) + 1
  redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[4], seq .. '-0', 'd', ARGV[5])
  redis.call('HSET', KEYS[1], 'last_seq', seq)
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'terminal', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PUBLISH', KEYS[3], 'end')
return 1
""".replace("TERMINAL", str(TERMINAL))

# KEYS: run hash; ARGV: new status
_ADVANCE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
status = tonumber(status)
local new = tonumber(ARGV[1])
if status >= TERMINAL or new >= TERMINAL or new <= status then return 0 end
redis.call('HSET', KEYS[1], 'status', new)
return 1
""".replace("TERMINAL", str(TERMINAL))


def _terminal_json(t: TerminalRecord) -> bytes:
    return orjson.dumps(terminal_to_json(t))


def _terminal_from(raw: bytes) -> TerminalRecord:
    return terminal_from_json(orjson.loads(raw))


class RedisRunStore:
    def __init__(
        self,
        redis: Redis,
        prefix: str = "sluice:",
        max_events: int = 4096,
        retention: float = 600.0,
        live_ttl: float = 86400.0,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.max_events = max_events
        self.retention = retention
        self.live_ttl = int(live_ttl)
        self._append = redis.register_script(_APPEND)
        self._finish = redis.register_script(_FINISH)
        self._advance = redis.register_script(_ADVANCE)
        self.notifier = Notifier(redis, f"{prefix}cancel")

    def _keys(self, run_id: str) -> list[str]:
        base = f"{self.prefix}run:{run_id}"
        return [base, f"{base}:events", f"{base}:notify"]

    async def close(self) -> None:
        await self.notifier.close()

    async def create(self, record: RunRecord) -> None:
        key = self._keys(record.run_id)[0]
        fields: dict[str, Any] = {
            "tenant": record.tenant,
            "model": record.model,
            "created": record.created,
            "stream": int(record.stream),
            "status": int(record.status),
            "last_seq": 0,
            "owner": record.owner,
            "followers": 0,
            "meta": orjson.dumps(record.meta),
        }
        if not await self.redis.hsetnx(key, "status", int(record.status)):
            raise ValueError(f"run {record.run_id} exists")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self.live_ttl)
            await pipe.execute()

    async def get(self, run_id: str) -> RunRecord:
        raw = await self.redis.hgetall(self._keys(run_id)[0])
        if not raw or b"tenant" not in raw:
            raise UnknownRun(run_id)
        terminal = raw.get(b"terminal")
        return RunRecord(
            run_id,
            raw[b"tenant"].decode(),
            raw[b"model"].decode(),
            float(raw[b"created"]),
            stream=raw[b"stream"] == b"1",
            status=RunStatus(int(raw[b"status"])),
            terminal=_terminal_from(terminal) if terminal else None,
            last_seq=int(raw[b"last_seq"]),
            owner=raw.get(b"owner", b"").decode(),
            meta=orjson.loads(raw[b"meta"]),
        )

    async def advance(self, run_id: str, status: RunStatus) -> bool:
        result = await self._advance(keys=self._keys(run_id)[:1], args=[int(status)])
        if result == -1:
            raise UnknownRun(run_id)
        return result == 1

    async def finish(
        self, run_id: str, terminal: TerminalRecord, final: bytes | None = None
    ) -> bool:
        retention_ms = max(1, round(self.retention * 1000))
        args = [int(terminal.status), _terminal_json(terminal), retention_ms, self.max_events]
        if final is not None:
            args.append(final)
        result = await self._finish(keys=self._keys(run_id), args=args)
        if result == -1:
            raise UnknownRun(run_id)
        return result == 1

    async def queue_append(self, pipe: Any, run_id: str, payloads: list[bytes]) -> None:
        """Queue an append in a pipeline; its result is what `append`'s script returns."""
        await self._append(keys=self._keys(run_id), args=[self.max_events, *payloads], client=pipe)

    async def append(self, run_id: str, payloads: list[bytes]) -> int:
        result = await self._append(keys=self._keys(run_id), args=[self.max_events, *payloads])
        if result == -1:
            raise UnknownRun(run_id)
        if result == -2:
            raise LogClosed(run_id)
        return int(result)

    async def read(self, run_id: str, after: int, limit: int = 0) -> list[tuple[int, bytes]]:
        key, events, _ = self._keys(run_id)
        count = limit if limit > 0 else None
        entries = await self.redis.xrange(events, min=f"{after + 1}-0", max="+", count=count)
        if not entries:
            # NOTE: nothing after `after`: caught up, or trimmed away. The record tells; an
            # append landing in between shows up on a second look at the stream.
            last = await self.redis.hget(key, "last_seq")
            if last is None:
                raise UnknownRun(run_id)
            if after >= int(last):
                return []
            entries = await self.redis.xrange(events, min=f"{after + 1}-0", max="+", count=count)
        if not entries or int(entries[0][0].split(b"-")[0]) != after + 1:
            raise ResumeWindowExpired(run_id)
        return [(int(eid.split(b"-")[0]), fields[b"d"]) for eid, fields in entries]

    async def wait(self, run_id: str, after: int) -> None:
        key, _, channel = self._keys(run_id)
        notifier = self.notifier
        async with notifier.watching(channel) as changed:
            while True:
                changed.clear()
                latest = notifier.latest(channel)
                if latest is None:  # not known since the channel was subscribed: ask once
                    last_seq, status = await self.redis.hmget(key, ["last_seq", "status"])
                    if last_seq is None:
                        raise UnknownRun(run_id)
                    latest = notifier.note(
                        channel, _ENDED if int(status) >= TERMINAL else int(last_seq)
                    )
                if latest > after:
                    return
                try:
                    async with asyncio.timeout(_POLL):
                        await changed.wait()
                except TimeoutError:
                    # NOTE: the subscription may have landed after a publish that the first
                    # look missed; after a quiet poll interval, look at the record again.
                    notifier.forget(channel)

    async def add_follower(self, run_id: str, delta: int) -> int:
        key = self._keys(run_id)[0]
        if not await self.redis.exists(key):
            raise UnknownRun(run_id)
        return max(0, int(await self.redis.hincrby(key, "followers", delta)))

    async def signal_cancel(self, run_id: str, source: str) -> None:
        await self.redis.publish(self.notifier.cancel_channel, f"{run_id} {source}")

    def cancel_signals(self) -> AsyncIterator[tuple[str, str]]:
        return self.notifier.cancels()

    async def keep_alive(self, owner: str, ttl: float) -> None:
        await self.redis.set(f"{self.prefix}owner:{owner}", 1, px=max(1, int(ttl * 1000)))

    async def owner_alive(self, owner: str) -> bool:
        return bool(await self.redis.exists(f"{self.prefix}owner:{owner}"))
