"""The Redis run store, shared by gateway replicas: a hash per run, a Redis Stream per event log.

Transitions run as Lua scripts (`redis_scripts`), so "append only while live" and "the one
terminal transition" hold across replicas without read-modify-write races. Followers learn of
new events from a pub/sub channel per run, cancels travel on one channel for all replicas, and
each replica keeps a lease key alive so others can tell a run whose owner died. Ended runs
expire after `retention` seconds; a log keeps at most `max_events` entries.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.commands.core import AsyncScript

from gateway.runs.status import RunStatus
from gateway.state.redis_notify import Notifier
from gateway.state.redis_scripts import (
    ADVANCE,
    APPEND,
    APPLY,
    CREATE,
    FINISH,
    FOLLOWERS,
    TERMINAL,
    ScriptBatch,
    pack_events,
)
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
    terminal_from_json,
    terminal_to_json,
)

_POLL = 0.5  # seconds between re-reads while waiting (a missed publish costs at most this)
_ENDED = float("inf")  # a finished run: every `after` is behind it


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
        self._create = redis.register_script(CREATE)
        self._append = redis.register_script(APPEND)
        self._finish = redis.register_script(FINISH)
        self._advance = redis.register_script(ADVANCE)
        self._followers_script = redis.register_script(FOLLOWERS)
        self._apply = redis.register_script(APPLY)
        self._followers: dict[str, int] = {}  # this replica's followers per run
        self.notifier = Notifier(redis, f"{prefix}cancel")

    @staticmethod
    def _call(script: AsyncScript, code: str, keys: list[str], args: list[Any], client: Any) -> Any:
        """The script on `client`: a call to await on the client itself, queued by its sha in
        a pipeline, or added to a `ScriptBatch` under its `code` (its index is returned).
        NOTE: redis-py would ask SCRIPT EXISTS before every pipeline holding a script (a
        second round trip per write-behind tick); a Redis that lost its scripts answers
        NOSCRIPT instead, and the write-behind loads them (`load_scripts`) and sends again."""
        if isinstance(client, ScriptBatch):
            return client.add(code, keys, args)
        if isinstance(client, Pipeline):
            return client.evalsha(script.sha, len(keys), *keys, *args)
        return script(keys=keys, args=args, client=client)

    def queue_batch(self, pipe: Pipeline, batch: ScriptBatch) -> None:
        """The apply script for the batch's calls, queued by its sha in `pipe`."""
        pipe.evalsha(self._apply.sha, len(batch.keys), *batch.keys, *batch.args)

    async def load_scripts(self) -> None:
        """Load the scripts pipelines call by sha (after Redis came back without them)."""
        for script in (self._apply, self._followers_script):
            await self.redis.script_load(script.script)

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
        """The run's record, in one round trip (a script: refused if the id is taken)."""
        keys, args = self.create_call(record)
        if not await self._create(keys=keys, args=args):
            raise ValueError(f"run {record.run_id} exists")

    def create_call(self, record: RunRecord) -> tuple[list[str], list[Any]]:
        """The create script's keys and args: it also runs as part of a larger one
        (gateway/state/redis_open.py)."""
        args: list[Any] = [self.live_ttl]
        for name, value in self.record_fields(record).items():
            args += [name, value]
        return self._keys(record.run_id)[:1], args

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
        return self._call(self._advance, "v", self._keys(run_id)[:1], [int(status)], client)

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
        return self._call(self._finish, "f", self._keys(run_id), args, client)

    def queue_append(
        self, client: Any, run_id: str, chunks: list[Chunk], first_seq: int = 0
    ) -> Any:
        """The append script; `first_seq` numbers the chunks (0: after the last one)."""
        args = [self.max_events, first_seq, pack_events(chunks)]
        return self._call(self._append, "a", self._keys(run_id)[:3], args, client)

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

    async def wait(self, run_id: str, after: int, deliver: Deliver | None = None) -> int:
        """As the protocol says; events come from Redis, so `deliver` is never offered any."""
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
                    return after
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

    def add_follower_now(self, run_id: str, delta: int) -> None:
        return None  # every count is a round trip

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
        args = [self.replica, count, self.live_ttl]
        return self._call(self._followers_script, "c", [key, followers], args, client)

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
