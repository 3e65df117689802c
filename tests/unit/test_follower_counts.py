"""Follower counts under concurrency, on every run store: a follower leaving while another
arrives (a client dropping a stream and resuming it at once on the same replica) must leave
the count at one, whatever order the two calls' round trips to Redis take. A replica that read
its own count before the other call had written it lost one update: the count said 0 while a
client read the run, so the disconnect grace cancelled it (found by the soak, deploy/soak/);
or it said 2 after one had left, so an abandoned run was never cancelled."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from gateway.state.run_store import RunRecord
from gateway.state.run_store_redis import RedisRunStore
from tests.unit.test_run_store import redis_space, store  # noqa: F401 (fixtures)

MOVES = ((1, -1), (-1, 1), (1, 1, -1, -1, -1), (-1, 1, 1, -1))


@pytest.mark.parametrize("moves", MOVES)
async def test_concurrent_arrivals_and_departures_leave_the_exact_count(store, moves):  # noqa: F811
    run = "run-1"
    await store.create(RunRecord(run, tenant="t", model="m", created=0.0))
    await store.add_follower(run, 1)
    await store.add_follower(run, 1)
    await asyncio.gather(*(store.add_follower(run, delta) for delta in moves))
    expected = 2 + sum(moves)
    assert await store.followers(run) == expected
    assert await store.add_follower(run, 0) == expected


async def test_the_count_in_redis_is_the_last_one_counted_here(redis_space):  # noqa: F811
    """Whatever order the concurrent writes reached Redis in, the last word is the count this
    replica holds now (each replica's count is absolute, so the final write decides)."""
    client, prefix = redis_space
    here = RedisRunStore(client, prefix=prefix, max_events=5, replica="r1")
    other = RedisRunStore(client, prefix=prefix, max_events=5, replica="r2")
    run = "run-1"
    await here.create(RunRecord(run, tenant="t", model="m", created=0.0))
    await other.add_follower(run, 1)  # a follower on another replica: 1 of the sum
    for moves in itertools.permutations((1, 1, -1)):
        before = here.local_followers(run)
        await asyncio.gather(*(here.add_follower(run, delta) for delta in moves))
        assert here.local_followers(run) == before + 1
        assert await other.followers(run) == 1 + here.local_followers(run)
    await here.close()
    await other.close()


async def test_a_follower_is_counted_at_once_only_where_the_runs_log_is_here(store):  # noqa: F811
    """`add_follower_now`: the in-process store and a replica's own runs on Redis count with no
    round trip; plain Redis counts nothing and says so (None), for the caller to await."""
    run = "run-1"
    await store.create(RunRecord(run, tenant="t", model="m", created=0.0))
    if isinstance(store, RedisRunStore):
        assert store.add_follower_now(run, 1) is None
        assert await store.followers(run) == 0
        return
    assert store.add_follower_now(run, 1) == 1
    assert store.add_follower_now(run, 1) == 2
    assert await store.followers(run) == 2  # Redis too, for the mirrored store
    assert store.add_follower_now(run, -1) == 1
    assert await store.add_follower(run, 0) == 1
