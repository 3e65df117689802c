"""The Redis run store, shared by gateway replicas: a hash per run, a Redis Stream per event log.

Transitions run as Lua scripts, so "append only while live" and "the one terminal transition" hold
across replicas without read-modify-write races. Followers learn of new events from a pub/sub
channel per run (the store is re-read after subscribing, so nothing is missed in between).
Ended runs expire after `retention` seconds; a log keeps at most `max_events` entries.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from redis.asyncio import Redis

from gateway.runs.state import RunStatus
from gateway.runs.store import ResumeWindowExpired, RunRecord, TerminalRecord, UnknownRun

TERMINAL = int(RunStatus.COMPLETED)

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

# KEYS: run hash, events stream, notify channel; ARGV: status, terminal json, retention seconds
_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if tonumber(status) >= TERMINAL then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'terminal', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
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
    return orjson.dumps(
        {
            "status": int(t.status),
            "cause": t.cause,
            "finish_reason": t.finish_reason,
            "completion": t.completion,
            "error": t.error,
            "at": t.at,
        }
    )


def _terminal_from(raw: bytes) -> TerminalRecord:
    d = orjson.loads(raw)
    return TerminalRecord(
        RunStatus(d["status"]), d["cause"], d["finish_reason"], d["completion"], d["error"], d["at"]
    )


class RedisRunStore:
    def __init__(
        self,
        redis: Redis,
        prefix: str = "sluice:",
        max_events: int = 4096,
        retention: float = 3600.0,
        live_ttl: float = 86400.0,
    ) -> None:
        self.redis = redis
        self.prefix = prefix
        self.max_events = max_events
        self.retention = int(retention)
        self.live_ttl = int(live_ttl)
        self._append = redis.register_script(_APPEND)
        self._finish = redis.register_script(_FINISH)
        self._advance = redis.register_script(_ADVANCE)

    def _keys(self, run_id: str) -> list[str]:
        base = f"{self.prefix}run:{run_id}"
        return [base, f"{base}:events", f"{base}:notify"]

    async def create(self, record: RunRecord) -> None:
        key = self._keys(record.run_id)[0]
        fields: dict[str, Any] = {
            "tenant": record.tenant,
            "model": record.model,
            "created": record.created,
            "stream": int(record.stream),
            "status": int(record.status),
            "last_seq": 0,
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
            meta=orjson.loads(raw[b"meta"]),
        )

    async def advance(self, run_id: str, status: RunStatus) -> bool:
        result = await self._advance(keys=self._keys(run_id)[:1], args=[int(status)])
        if result == -1:
            raise UnknownRun(run_id)
        return result == 1

    async def finish(self, run_id: str, terminal: TerminalRecord) -> bool:
        args = [int(terminal.status), _terminal_json(terminal), self.retention]
        result = await self._finish(keys=self._keys(run_id), args=args)
        if result == -1:
            raise UnknownRun(run_id)
        return result == 1

    async def append(self, run_id: str, payloads: list[bytes]) -> int:
        result = await self._append(keys=self._keys(run_id), args=[self.max_events, *payloads])
        if result == -1:
            raise UnknownRun(run_id)
        if result == -2:
            raise ValueError(f"run {run_id} has ended; its log is closed")
        return int(result)

    async def read(self, run_id: str, after: int) -> list[tuple[int, bytes]]:
        key, events, _ = self._keys(run_id)
        last = await self.redis.hget(key, "last_seq")
        if last is None:
            raise UnknownRun(run_id)
        if after >= int(last):
            return []
        entries = await self.redis.xrange(events, min=f"{after + 1}-0", max="+")
        if not entries or int(entries[0][0].split(b"-")[0]) != after + 1:
            raise ResumeWindowExpired(run_id)
        return [(int(eid.split(b"-")[0]), fields[b"d"]) for eid, fields in entries]

    async def wait(self, run_id: str, after: int) -> None:
        channel = self._keys(run_id)[2]
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(channel)
        try:
            while True:
                record = await self.get(run_id)
                if record.last_seq > after or record.status.is_terminal:
                    return
                await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                await asyncio.sleep(0)
        finally:
            await pubsub.unsubscribe(channel)
            await pubsub.aclose()
