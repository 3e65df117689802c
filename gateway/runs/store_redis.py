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
from gateway.runs.status import RunStatus
from gateway.runs.store import (
    Chunk,
    LogClosed,
    LogEvent,
    LogEvents,
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

# NOTE: appends and the ending name their seq numbers (0: "the next ones"), and skip any the log
# already has, so the owner's write-behind can send a batch again after a lost connection
# without doubling events. KEYS: run hash, events stream, notify channel
# ARGV: max_events, first seq (0: next), then per event: payload, text mark, text, where the
# mark is '-' for an event that is not a plain text delta, else 't' and its choice index
_APPEND = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if tonumber(status) >= TERMINAL then return -2 end
local last = tonumber(redis.call('HGET', KEYS[1], 'last_seq'))
local seq = tonumber(ARGV[2]) - 1
if seq < 0 then seq = last end
for i = 3, #ARGV, 3 do
  seq = seq + 1
  if seq > last then
    local id = seq .. '-0'
    if ARGV[i + 1] == '-' then
      redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[1], id, 'd', ARGV[i])
    else
      local index = string.sub(ARGV[i + 1], 2)
      redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[1], id, 'd', ARGV[i], 't', ARGV[i + 2], 'i', index)
    end
  end
end
if seq > last then
  redis.call('HSET', KEYS[1], 'last_seq', seq)
  redis.call('PUBLISH', KEYS[3], seq)
end
return seq
""".replace("TERMINAL", str(TERMINAL))

# The one terminal transition; a repeat of the same ending (a write-behind retry) is its win.
# KEYS: run hash, events stream, notify channel, followers hash
# ARGV: status, terminal json, retention ms, max_events[, final seq (0: next), final payload]
_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return -1 end
if tonumber(status) >= TERMINAL then
  if redis.call('HGET', KEYS[1], 'terminal') == ARGV[2] then return 1 end
  return 0
end
if #ARGV >= 6 then
  local last = tonumber(redis.call('HGET', KEYS[1], 'last_seq'))
  local seq = tonumber(ARGV[5])
  if seq == 0 then seq = last + 1 end
  if seq > last then
    redis.call('XADD', KEYS[2], 'MAXLEN', ARGV[4], seq .. '-0', 'd', ARGV[6])
    redis.call('HSET', KEYS[1], 'last_seq', seq)
  end
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'terminal', ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
redis.call('PEXPIRE', KEYS[4], ARGV[3])
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

# A replica's own follower count, absolute (so a retry cannot count twice); returns the sum
# over replicas. KEYS: run hash, followers hash; ARGV: replica, count, ttl s
_FOLLOWERS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if tonumber(ARGV[2]) > 0 then
  redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
  if redis.call('TTL', KEYS[2]) < 0 then redis.call('EXPIRE', KEYS[2], ARGV[3]) end
else
  redis.call('HDEL', KEYS[2], ARGV[1])
end
local total = 0
for _, n in ipairs(redis.call('HVALS', KEYS[2])) do total = total + tonumber(n) end
return total
"""


def _fields(payload: bytes, text: str | None, index: int) -> dict[str, Any]:
    return {"d": payload} if text is None else {"d": payload, "t": text, "i": index}


def _event(entry_id: bytes, fields: dict[bytes, bytes]) -> LogEvent:
    seq, text = int(entry_id.split(b"-")[0]), fields.get(b"t")
    if text is None:
        return (seq, fields[b"d"], None, 0)
    return (seq, fields[b"d"], text.decode(), int(fields[b"i"]))


class RedisRunStore:
    def __init__(
        self,
        redis: Redis,
        prefix: str = "sluice:",
        max_events: int = 4096,
        retention: float = 600.0,
        live_ttl: float = 86400.0,
        replica: str = "",
    ) -> None:
        """`replica` names this gateway replica: its followers are counted under it."""
        self.redis = redis
        self.prefix = prefix
        self.max_events = max_events
        self.retention = retention
        self.live_ttl = int(live_ttl)
        self.replica = replica or "replica"
        self._append = redis.register_script(_APPEND)
        self._finish = redis.register_script(_FINISH)
        self._advance = redis.register_script(_ADVANCE)
        self._followers_script = redis.register_script(_FOLLOWERS)
        self._followers: dict[str, int] = {}  # this replica's followers per run
        self.notifier = Notifier(redis, f"{prefix}cancel")

    def _keys(self, run_id: str) -> list[str]:
        base = f"{self.prefix}run:{run_id}"
        return [base, f"{base}:events", f"{base}:notify", f"{base}:followers"]

    async def close(self) -> None:
        await self.notifier.close()

    def record_fields(self, record: RunRecord) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "tenant": record.tenant,
            "model": record.model,
            "created": record.created,
            "stream": int(record.stream),
            "status": int(record.status),
            "last_seq": 0,
            "owner": record.owner,
            "meta": orjson.dumps(record.meta),
        }
        if record.terminal is not None:
            fields["terminal"] = terminal_to_json(record.terminal)
        return fields

    async def create(self, record: RunRecord) -> None:
        key = self._keys(record.run_id)[0]
        if not await self.redis.hsetnx(key, "status", int(record.status)):
            raise ValueError(f"run {record.run_id} exists")
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=self.record_fields(record))
            pipe.expire(key, self.live_ttl)
            await pipe.execute()

    def queue_restore(self, pipe: Any, record: RunRecord, events: LogEvents) -> None:
        """Queue writing a run back whole (Redis lost it, restarted empty): its record as the
        owner has it, and the events it still keeps (their own seq numbers)."""
        key, stream, _, _ = self._keys(record.run_id)
        fields = self.record_fields(record) | {"last_seq": events[-1][0] if events else 0}
        pipe.delete(key, stream)
        for seq, payload, text, index in events:
            pipe.xadd(stream, _fields(payload, text, index), id=f"{seq}-0", maxlen=self.max_events)
        pipe.hset(key, mapping=fields)
        ttl = self.retention if record.status.is_terminal else self.live_ttl
        pipe.expire(key, max(1, int(ttl)))
        pipe.expire(stream, max(1, int(ttl)))

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
            terminal=terminal_from_json(terminal) if terminal else None,
            last_seq=int(raw[b"last_seq"]),
            owner=raw.get(b"owner", b"").decode(),
            meta=orjson.loads(raw[b"meta"]),
        )

    async def advance(self, run_id: str, status: RunStatus) -> bool:
        result = await self.queue_advance(self.redis, run_id, status)
        if result == -1:
            raise UnknownRun(run_id)
        return result == 1

    def queue_advance(self, client: Any, run_id: str, status: RunStatus) -> Any:
        """The advance script on `client` (the client itself, or a pipeline to queue it in)."""
        return self._advance(keys=self._keys(run_id)[:1], args=[int(status)], client=client)

    async def finish(
        self, run_id: str, terminal: TerminalRecord, final: Chunk | None = None
    ) -> bool:
        result = await self.queue_finish(self.redis, run_id, terminal, final)
        if result == -1:
            raise UnknownRun(run_id)
        return result == 1

    def queue_finish(
        self,
        client: Any,
        run_id: str,
        terminal: TerminalRecord,
        final: Chunk | None = None,
        final_seq: int = 0,
    ) -> Any:
        retention_ms = max(1, round(self.retention * 1000))
        args = [int(terminal.status), terminal_to_json(terminal), retention_ms, self.max_events]
        if final is not None:
            args += [final_seq, final[0]]
        return self._finish(keys=self._keys(run_id), args=args, client=client)

    def queue_append(
        self, client: Any, run_id: str, chunks: list[Chunk], first_seq: int = 0
    ) -> Any:
        """The append script; `first_seq` numbers the chunks (0: after the last one)."""
        args: list[Any] = [self.max_events, first_seq]
        for payload, text, index in chunks:
            if text is None:
                args += [payload, "-", ""]
            else:
                args += [payload, f"t{index}", text]
        return self._append(keys=self._keys(run_id)[:3], args=args, client=client)

    async def append(self, run_id: str, chunks: list[Chunk]) -> int:
        result = await self.queue_append(self.redis, run_id, chunks)
        if result == -1:
            raise UnknownRun(run_id)
        if result == -2:
            raise LogClosed(run_id)
        return int(result)

    async def read(self, run_id: str, after: int, limit: int = 0) -> LogEvents:
        key, events, _, _ = self._keys(run_id)
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
        return [_event(eid, fields) for eid, fields in entries]

    async def wait(self, run_id: str, after: int) -> None:
        key, _, channel, _ = self._keys(run_id)
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
        # NOTE: the count here moves before the round trip, so calls that overlap (a client
        # leaving one stream as it resumes on another) each count from the one before; and a
        # call whose write is answered after the count moved again writes it again, so Redis
        # ends with this replica's latest count whatever order the writes reached it in.
        count = max(0, self._followers.get(run_id, 0) + delta)
        self.count_locally(run_id, count)
        while True:
            total = await self.queue_followers(self.redis, run_id, count)
            if total == -1:
                self.count_locally(run_id, 0)
                raise UnknownRun(run_id)
            if (now := self.local_followers(run_id)) == count:
                return int(total)
            count = now

    def count_locally(self, run_id: str, count: int) -> None:
        if count:
            self._followers[run_id] = count
        else:
            self._followers.pop(run_id, None)

    def local_followers(self, run_id: str) -> int:
        return self._followers.get(run_id, 0)

    def queue_followers(self, client: Any, run_id: str, count: int) -> Any:
        """Set this replica's follower count of the run; the script returns every replica's."""
        key, _, _, followers = self._keys(run_id)
        return self._followers_script(
            keys=[key, followers], args=[self.replica, count, self.live_ttl], client=client
        )

    async def followers(self, run_id: str) -> int:
        return await self.add_follower(run_id, 0)

    async def signal_cancel(self, run_id: str, source: str) -> None:
        await self.redis.publish(self.notifier.cancel_channel, f"{run_id} {source}")

    def cancel_signals(self) -> AsyncIterator[tuple[str, str]]:
        return self.notifier.cancels()

    async def keep_alive(self, owner: str, ttl: float) -> None:
        await self.redis.set(f"{self.prefix}owner:{owner}", 1, px=max(1, int(ttl * 1000)))

    async def owner_alive(self, owner: str) -> bool:
        return bool(await self.redis.exists(f"{self.prefix}owner:{owner}"))
