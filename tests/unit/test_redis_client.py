"""The gateway's Redis client against a real Redis: the commands of one turn of the event loop
leave in one write, each caller still gets its own reply or error, and a Redis that cannot be
reached fails every caller as StoreUnavailable."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import ResponseError

from gateway.backends.local_worker import free_port
from gateway.state import redis_client
from gateway.state.redis_client import SharedRedis
from gateway.state.run_store import StoreUnavailable
from tests.support.redis_server import PrivateRedis

REDIS_URL = os.environ.get("SLUICE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


@pytest.fixture
async def shared():
    """The gateway's client on the test Redis, and a key prefix of this test's own."""
    client = SharedRedis(REDIS_URL)
    prefix = f"sluice-test-{uuid.uuid4().hex[:12]}:"
    yield client, prefix
    keys = [key async for key in client.redis.scan_iter(match=f"{prefix}*")]
    if keys:
        await client.redis.delete(*keys)
    await client.close()


@pytest.fixture
def writes(monkeypatch) -> list[int]:
    """One entry per write to a Redis connection (a command, or a pipeline of them)."""
    seen: list[int] = []
    cls = redis_client._HiredisPackedConnection if redis_client.HIREDIS_AVAILABLE else Connection
    send = cls.send_packed_command

    async def counting(self, command, check_health=True):
        seen.append(1)
        return await send(self, command, check_health)

    monkeypatch.setattr(cls, "send_packed_command", counting)
    return seen


@pytest.mark.redis
async def test_commands_of_one_turn_leave_in_one_write_each_with_its_own_reply(shared, writes):
    client, prefix = shared
    redis = client.redis
    await redis.set(f"{prefix}text", "hello")
    await redis.hset(f"{prefix}hash", "field", "value")
    writes.clear()
    results = await asyncio.gather(
        redis.get(f"{prefix}text"),
        redis.incr(f"{prefix}counter"),
        redis.incr(f"{prefix}text"),  # not a number: this one's own error
        redis.hgetall(f"{prefix}hash"),
        redis.exists(f"{prefix}missing"),
        return_exceptions=True,
    )
    assert results[0] == b"hello"
    assert results[1] == 1
    assert isinstance(results[2], ResponseError)
    assert results[3] == {b"field": b"value"}
    assert results[4] == 0
    assert len(writes) == 1


@pytest.mark.redis
async def test_scripts_called_together_load_themselves_once_redis_asks(shared):
    client, prefix = shared
    # a script text of this test's own: Redis has never seen it, so the first calls get
    # NOSCRIPT in the batch, and each loads it and calls again
    script = client.redis.register_script(
        f"-- {uuid.uuid4().hex}\nreturn redis.call('INCR', KEYS[1])"
    )
    counts = await asyncio.gather(*(script(keys=[f"{prefix}n"]) for _ in range(4)))
    assert sorted(counts) == [1, 2, 3, 4]


async def test_a_redis_out_of_reach_fails_every_command_of_the_batch():
    client = SharedRedis(f"redis://127.0.0.1:{free_port()}/0", timeout=0.5)
    try:
        results = await asyncio.gather(
            client.redis.get("a"), client.redis.set("b", 1), client.redis.ping(),
            return_exceptions=True,
        )  # fmt: skip
        assert all(isinstance(r, StoreUnavailable) for r in results), results
        assert len({id(r) for r in results}) == 3  # each caller its own exception
        assert not client.health.available
    finally:
        await client.close()


@pytest.mark.process
@pytest.mark.redis
async def test_a_connection_left_stale_by_a_restart_costs_no_command(tmp_path):
    server = PrivateRedis(tmp_path)
    server.start()
    client = SharedRedis(server.url)
    try:
        await client.redis.set("k", 1)  # a pooled connection to the server about to go
        server.kill()
        server.start()  # same port, empty
        assert await client.redis.set("k", 2)  # the write to the dead connection fails: retried
        assert await client.redis.get("k") == b"2"
        assert client.health.available
    finally:
        await client.close()
        server.stop()
