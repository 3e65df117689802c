"""The gateway's one Redis client, and how it behaves when Redis goes away.

Every command and pipeline goes through `GatewayRedis`, so there is one place that turns a lost
or hung Redis into `StoreUnavailable` (which the error middleware answers 503 `overloaded` with
retry-after) and tells `StoreHealth`. A pooled connection that went stale (Redis restarted)
fails on its first use: that command is retried once on a fresh connection, so a restart costs
no request. Commands time out after `timeout` seconds, so a hung Redis (SIGSTOP, a partition) is
an error in seconds, not a stall.

What costs the gateway CPU per command is kept down here: the commands issued in one turn of
the event loop leave together in one pipeline; hiredis packs them in C where it is installed
(as redis-py's sync client does; its asyncio client packs in Python, which showed in profiles
of the Redis store); a write is bounded without a task of its own.

While Redis is unavailable a prober pings it every half second; `StoreHealth` says since when it
has been away, which is what the outage grace (`--redis-outage-grace`) is measured against, and
wakes whoever waits for it to come back (the write-behind of run events, deferred writes).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import structlog
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import DataError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import HIREDIS_AVAILABLE

from gateway.state import redis_internals
from gateway.state.redis_internals import stream_writer
from gateway.state.run_store import StoreUnavailable
from gateway.state.store_health import PROBE_EVERY, StoreHealth
from gateway.tasks import stop_tasks

if HIREDIS_AVAILABLE:
    import hiredis

log = structlog.get_logger("sluice.redis")

REDIS_ERRORS = (RedisConnectionError, RedisTimeoutError, OSError)


class _HiredisPackedConnection(Connection):
    """A connection whose commands hiredis packs (the same bytes, without a Python loop) and
    whose writes are bounded in the caller's task."""

    def pack_command(self, *args: Any) -> list[bytes]:
        first = args[0]
        if isinstance(first, str):  # 'SCRIPT LOAD' and the like: the words go apart
            args = (*first.encode().split(), *args[1:])
        elif b" " in first:
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError as exc:
            raise DataError(str(exc)) from exc

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        # NOTE: redis-py bounds every write with asyncio.wait_for, which on Python 3.11 is a
        # task and a turn of the loop per command; asyncio.timeout bounds the same drain (the
        # write itself is done at once) in the caller's own task.
        if not self.is_connected or (check_health and self.health_check_interval):
            await super().send_packed_command(command, check_health)
            return
        if isinstance(command, str):
            command = command.encode()
        if isinstance(command, bytes):
            command = [command]
        writer = stream_writer(self)
        try:
            writer.writelines(command)
            async with asyncio.timeout(self.socket_timeout):
                await writer.drain()  # raises here if the connection was lost
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise RedisTimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)
            raise RedisConnectionError(f"Error while writing to socket: {exc.args}") from exc
        except BaseException:
            await self.disconnect(nowait=True)
            raise


class _GatewayPipeline(Pipeline):
    health: StoreHealth

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        try:
            return await super().execute(raise_on_error)
        except REDIS_ERRORS as exc:
            self.health.failed()
            raise StoreUnavailable(type(exc).__name__) from exc


_Queued = tuple[tuple[Any, ...], dict[str, Any], "asyncio.Future[Any]"]


class GatewayRedis(Redis):
    """redis.asyncio.Redis whose failures to reach Redis are `StoreUnavailable`, and whose
    commands leave in one pipeline per turn of the event loop."""

    health: StoreHealth

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._queued: list[_Queued] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        # NOTE: every command issued in this turn of the loop (a claim, an admission, a run's
        # record, a refund, ... of as many requests as are at that point) goes out with the
        # others in one pipeline: one write and one read instead of one each. Replies are
        # each command's own, errors included; a lost Redis fails them all.
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if not self._queued:  # the first of this turn: the sender starts at the next one
            task = loop.create_task(self._send())
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)
        self._queued.append((args, options, done))
        return await done

    async def _send(self) -> None:
        batch, self._queued = self._queued, []
        try:
            if len(batch) == 1:
                args, options, _ = batch[0]
                results = [await self._one(*args, **options)]
            else:
                pipe = self.pipeline(transaction=False)
                for args, options, _ in batch:
                    pipe.execute_command(*args, **options)
                async with pipe:
                    results = await pipe.execute(raise_on_error=False)
        except asyncio.CancelledError:  # shutdown
            for _, _, done in batch:
                done.cancel()
            raise
        except Exception as exc:  # each caller gets it as its own answer
            for _, _, done in batch:
                if not done.done():
                    done.set_exception(_again(exc))
            return
        for (_, _, done), result in zip(batch, results, strict=True):
            if done.done():  # its caller went away
                continue
            if isinstance(result, Exception):
                done.set_exception(result)
            else:
                done.set_result(result)

    async def _one(self, *args: Any, **options: Any) -> Any:
        try:
            return await super().execute_command(*args, **options)
        except REDIS_ERRORS as exc:
            self.health.failed()
            raise StoreUnavailable(type(exc).__name__) from exc

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        pipe = _GatewayPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )
        pipe.health = self.health
        return pipe


def _again(exc: Exception) -> Exception:
    """A fresh StoreUnavailable for each caller of a failed batch (tracebacks stay apart)."""
    return StoreUnavailable(*exc.args) if isinstance(exc, StoreUnavailable) else exc


class SharedRedis:
    """The client, its health, and the prober that notices when Redis is back."""

    def __init__(self, url: str, max_connections: int = 256, timeout: float = 2.0) -> None:
        if HIREDIS_AVAILABLE:
            redis_internals.check()  # the packed connection writes to redis-py's private writer
        # NOTE: a blocking pool: under a burst, a command waits for a free connection instead of
        # failing (the default pool raises past its size). One retry, on a connection error
        # only: a stale pooled connection fails before anything reached the new server.
        pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout * 2,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 1, (RedisConnectionError,)),
            connection_class=_HiredisPackedConnection if HIREDIS_AVAILABLE else Connection,
        )
        self.timeout = timeout
        self.health = StoreHealth()
        self.redis = GatewayRedis(connection_pool=pool)
        self.redis.health = self.health
        self.health.on_failure = self._start_probing
        self._prober: asyncio.Task[None] | None = None

    async def ping(self) -> bool:
        """Whether Redis answers now (bounded by the command timeout)."""
        try:
            await self.redis.ping()
        except StoreUnavailable:
            return False
        self.health.recovered()
        return True

    def _start_probing(self) -> None:
        if self._prober is None or self._prober.done():
            with contextlib.suppress(RuntimeError):  # no running loop: nothing to probe for
                self._prober = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        while not self.health.available:
            await asyncio.sleep(PROBE_EVERY)
            await self.ping()

    async def close(self) -> None:
        await stop_tasks([self._prober])
        await self.redis.aclose()
