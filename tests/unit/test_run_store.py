"""The run store contract: ordered event log with retention, one terminal transition, followers
woken by appends. Every backend runs the same table: in-process, and a real Redis."""

from __future__ import annotations

import asyncio

import pytest
from redis.asyncio import Redis

from gateway.runs.status import RunStatus
from gateway.state.run_store import (
    Chunk,
    LogClosed,
    ResumeWindowExpired,
    RunRecord,
    TerminalRecord,
    UnknownRun,
    log_chunk,
)
from gateway.state.run_store_memory import MemoryRunStore
from gateway.state.run_store_mirrored import MirroredRunStore
from gateway.state.run_store_redis import RedisRunStore
from tests.support.redis_scratch import scratch_redis
from tests.support.redis_server import PrivateRedis


@pytest.fixture
async def redis_space():
    async with scratch_redis() as space:
        yield space


@pytest.fixture(params=["memory", "redis", "mirrored"])
async def store(request):
    if request.param == "memory":  # no Redis at all: it runs in the fast tier
        yield MemoryRunStore(max_events=5)
        return
    async with scratch_redis() as (client, prefix):
        store = RedisRunStore(client, prefix=prefix, max_events=5)
        if request.param == "mirrored":
            store = MirroredRunStore(store)
        yield store
        await store.close()


def ev(*payloads: bytes) -> list[Chunk]:
    return [log_chunk(p) for p in payloads]


def log_of(*pairs) -> list:
    return [(seq, p, None, 0) for seq, p in pairs]


async def new_run(store, run_id: str = "run-1") -> str:
    await store.create(RunRecord(run_id, tenant="t", model="m", created=0.0))
    return run_id


async def test_events_get_consecutive_seq_numbers_and_read_after_n(store):
    run = await new_run(store)
    assert await store.append(run, ev(b"a", b"b")) == 2
    assert await store.append(run, ev(b"c")) == 3
    assert await store.read(run, 0) == log_of((1, b"a"), (2, b"b"), (3, b"c"))
    assert await store.read(run, 2) == log_of((3, b"c"))
    assert await store.read(run, 3) == []


async def test_events_past_retention_are_a_resume_window_error(store):
    run = await new_run(store)
    await store.append(run, ev(*(b"%d" % i for i in range(1, 8))))  # keeps 3..7
    assert [e[0] for e in await store.read(run, 2)] == [3, 4, 5, 6, 7]
    with pytest.raises(ResumeWindowExpired):
        await store.read(run, 1)


async def test_exactly_one_terminal_transition(store):
    run = await new_run(store)
    assert await store.advance(run, RunStatus.DECODING)
    assert not await store.advance(run, RunStatus.QUEUED)  # never backwards
    done = TerminalRecord(RunStatus.COMPLETED, "completed", "stop")
    cancelled = TerminalRecord(RunStatus.CANCELLED, "cancel:client")
    results = await asyncio.gather(store.finish(run, done), store.finish(run, cancelled))
    assert results == [True, False]
    record = await store.get(run)
    assert record.status == RunStatus.COMPLETED and record.terminal == done
    assert not await store.advance(run, RunStatus.FINALIZING)
    with pytest.raises(LogClosed):
        await store.append(run, ev(b"late"))


async def test_followers_wake_on_append_and_on_finish(store):
    run = await new_run(store)
    waiter = asyncio.create_task(store.wait(run, 0))
    await asyncio.sleep(0.01)  # NOTE: that it does not return early can only be seen over time
    assert not waiter.done()
    await store.append(run, ev(b"x"))
    await asyncio.wait_for(waiter, 1)
    waiter = asyncio.create_task(store.wait(run, 1))
    await asyncio.sleep(0.01)  # NOTE: as above
    assert not waiter.done()
    await store.finish(run, TerminalRecord(RunStatus.FAILED, "worker_error"))
    await asyncio.wait_for(waiter, 1)


class Taker:
    """A follower's `deliver`: takes what it is offered until told to decline (or to fail)."""

    def __init__(self) -> None:
        self.took: list = []
        self.declines = False
        self.fails = False

    def __call__(self, events) -> bool:
        if self.fails:
            raise ConnectionResetError("the client went away")
        if self.declines:
            return False
        self.took += events
        return True


async def test_a_caught_up_follower_takes_appends_itself_until_it_declines(store):
    run = await new_run(store)
    taker = Taker()
    waiter = asyncio.create_task(store.wait(run, 0, taker))
    await asyncio.sleep(0.01)  # NOTE: that it does not return early can only be seen over time
    await store.append(run, ev(b"a", b"b"))
    await store.append(run, ev(b"c"))
    if isinstance(store, RedisRunStore):  # events come back from Redis: never delivered
        assert await asyncio.wait_for(waiter, 1) == 0 and taker.took == []
        return
    assert not waiter.done()  # it took both batches without waking
    assert taker.took == log_of((1, b"a"), (2, b"b"), (3, b"c"))
    taker.declines = True
    await store.append(run, ev(b"d"))
    assert await asyncio.wait_for(waiter, 1) == 3  # what it took; "d" it reads itself
    assert await store.read(run, 3) == log_of((4, b"d"))


async def test_a_follower_whose_delivery_fails_is_woken_and_loses_nothing(store):
    run = await new_run(store)
    taker = Taker()
    waiter = asyncio.create_task(store.wait(run, 0, taker))
    await asyncio.sleep(0.01)  # NOTE: as above
    await store.append(run, ev(b"a"))
    taker.fails = True
    await store.append(run, ev(b"b"))  # the appending driver is not failed by its follower
    taken = await asyncio.wait_for(waiter, 1)
    assert taken == (0 if isinstance(store, RedisRunStore) else 1)
    assert await store.read(run, taken) == log_of((1, b"a"), (2, b"b"))[taken:]
    finished = asyncio.create_task(store.wait(run, 2, Taker()))
    await asyncio.sleep(0.01)  # NOTE: as above
    await store.finish(run, TerminalRecord(RunStatus.COMPLETED, "completed"))
    assert await asyncio.wait_for(finished, 1) == 2  # the ending wakes a taker too


async def test_a_run_forgotten_under_a_taker_keeps_what_it_took():
    store = MemoryRunStore()
    run = await new_run(store)
    untaken = asyncio.create_task(store.wait(run, 0))
    taker = Taker()
    taking = asyncio.create_task(store.wait(run, 0, taker))
    await asyncio.sleep(0.01)  # NOTE: as above
    await store.append(run, ev(b"a"))
    await asyncio.wait_for(untaken, 1)
    store.discard(run)
    assert await asyncio.wait_for(taking, 1) == 1  # not UnknownRun: "a" went out
    with pytest.raises(UnknownRun):
        await store.read(run, 1)


async def test_the_winning_finish_appends_its_final_event_the_loser_nothing(store):
    run = await new_run(store)
    await store.append(run, ev(b"a"))
    cancelled = TerminalRecord(RunStatus.CANCELLED, "cancel:client")
    assert await store.finish(run, cancelled, log_chunk(b"error-frame"))
    assert not await store.finish(run, TerminalRecord(RunStatus.FAILED, "x"), log_chunk(b"second"))
    assert await store.read(run, 0) == log_of((1, b"a"), (2, b"error-frame"))
    record = await store.get(run)
    assert (record.last_seq, record.terminal) == (2, cancelled)


async def test_terminal_records_keep_a_refusal_and_its_completion(store):
    run = await new_run(store)
    refused = TerminalRecord(
        RunStatus.FAILED,
        "upstream:BackendUnavailable",
        completion=b'{"choices":[],"note":"caf\xc3\xa9"}',
        error={"code": "overloaded"},
        refused=True,
        retry_after=2.0,
    )
    await store.finish(run, refused)
    assert (await store.get(run)).terminal == refused


async def test_text_chunks_keep_their_text_and_choice(store):
    run = await new_run(store)
    chunks = [log_chunk(b"{}", "你好", 2), log_chunk(b"{}", "", 0), log_chunk(b"{}")]
    await store.append(run, chunks)
    assert [e[1:] for e in await store.read(run, 0)] == chunks


async def test_reads_can_be_limited(store):
    run = await new_run(store)
    await store.append(run, ev(b"a", b"b", b"c", b"d"))
    assert await store.read(run, 1, limit=2) == log_of((2, b"b"), (3, b"c"))


async def test_followers_are_counted_and_never_negative(store):
    run = await new_run(store)
    assert await store.add_follower(run, 1) == 1
    assert await store.add_follower(run, 1) == 2
    assert await store.add_follower(run, -1) == 1
    assert await store.add_follower(run, 0) == 1
    assert await store.add_follower(run, -1) == 0


async def test_unknown_runs(store):
    with pytest.raises(UnknownRun):
        await store.get("nope")
    with pytest.raises(UnknownRun):
        await store.read("nope", 0)
    with pytest.raises(UnknownRun):
        await store.add_follower("nope", 1)


def test_terminal_record_needs_a_terminal_status():
    with pytest.raises(ValueError):
        TerminalRecord(RunStatus.DECODING, "x")
    assert RunStatus.COMPLETED.is_terminal and not RunStatus.FINALIZING.is_terminal


async def test_a_run_ended_by_another_replica_is_read_from_redis_by_the_owner(redis_space):
    client, prefix = redis_space
    owner = MirroredRunStore(RedisRunStore(client, prefix=prefix, max_events=50))
    other = RedisRunStore(client, prefix=prefix, max_events=50)
    try:
        run = await new_run(owner)
        await owner.append(run, ev(b"a"))
        await owner.writes.settle(run)  # in Redis now, as it is a few ms after any append
        waiter = asyncio.create_task(owner.wait(run, 1))
        await asyncio.sleep(0.01)  # NOTE: the owner is waiting on its mirror when it happens
        lost = TerminalRecord(RunStatus.FAILED, "owner_lost")
        assert await other.finish(run, lost, log_chunk(b"lost-frame"))  # it took the owner for dead
        await owner.append(run, ev(b"late"))  # taken locally; Redis refuses it on the way
        await owner.writes.settle(run)
        with pytest.raises(LogClosed):
            await owner.append(run, ev(b"later"))  # the owner knows now
        await asyncio.wait_for(waiter, 2)
        assert await owner.read(run, 1) == log_of((2, b"lost-frame"))  # now from Redis
        assert (await owner.get(run)).terminal == lost
    finally:
        await owner.close()


async def test_the_owners_appends_reach_redis_in_order_and_before_its_ending(redis_space):
    client, prefix = redis_space
    owner = MirroredRunStore(RedisRunStore(client, prefix=prefix, max_events=500))
    elsewhere = RedisRunStore(client, prefix=prefix, max_events=500)
    try:
        runs = [await new_run(owner, f"run-{i}") for i in range(5)]
        for n in range(40):  # interleaved appends of five runs, several per tick
            for run in runs:
                await owner.append(run, ev(b"%d" % n))
            if n % 7 == 0:
                await asyncio.sleep(0.003)  # NOTE: the scenario: appends across write ticks
        for run in runs:
            done = TerminalRecord(RunStatus.COMPLETED, "completed")
            await owner.finish(run, done, log_chunk(b"end"))
            events = await elsewhere.read(run, 0)  # what another replica sees
            assert [e[1] for e in events] == [b"%d" % n for n in range(40)] + [b"end"]
            assert [e[0] for e in events] == list(range(1, 42))
    finally:
        await owner.close()


@pytest.mark.process
@pytest.mark.redis
async def test_the_owners_writes_reach_a_redis_that_has_none_of_its_scripts(tmp_path):
    server = PrivateRedis(tmp_path)  # a fresh Redis: the write-behind's script is not loaded
    server.start()
    client = Redis.from_url(server.url)
    owner = MirroredRunStore(RedisRunStore(client, prefix="p:", max_events=50))
    elsewhere = RedisRunStore(client, prefix="p:", max_events=50)
    try:
        run = await new_run(owner)
        await owner.append(run, ev(b"a", b"b"))
        await owner.finish(run, TerminalRecord(RunStatus.COMPLETED, "completed"), log_chunk(b"z"))
        assert [e[1] for e in await elsewhere.read(run, 0)] == [b"a", b"b", b"z"]
        assert (await elsewhere.get(run)).status is RunStatus.COMPLETED
    finally:
        await owner.close()
        await client.aclose()
        server.stop()


async def test_a_runs_events_are_bounded_in_bytes_older_ones_dropped():
    store = MemoryRunStore(max_events=100, max_event_bytes=1000)
    run = await new_run(store)
    await store.append(run, ev(*(b"%03d" % i + b"x" * 157 for i in range(10))))  # 280 B each
    assert [e[0] for e in await store.read(run, 7)] == [8, 9, 10]
    with pytest.raises(ResumeWindowExpired):
        await store.read(run, 6)
    assert store.bytes_held() == 3 * 280  # 160 B of payload, 120 B of overhead each


async def test_ended_runs_are_bounded_in_bytes_oldest_first_and_followed_ones_kept():
    store = MemoryRunStore(retention_bytes=2500)
    ending = TerminalRecord(RunStatus.COMPLETED, "completed", "stop", completion=b"x" * 900)
    followed = await new_run(store, "followed")
    await store.add_follower(followed, 1)  # a client still reading its last events
    await store.finish(followed, ending)
    for i in range(4):
        await store.finish(await new_run(store, f"run-{i}"), ending)
    assert store.ended_bytes <= 2500
    with pytest.raises(UnknownRun):
        await store.get("run-1")
    assert (await store.get("run-3")).terminal == ending
    assert (await store.get("followed")).terminal == ending  # spared while followed
    await store.add_follower(followed, -1)
    await store.finish(await new_run(store, "run-4"), ending)
    with pytest.raises(UnknownRun):
        await store.get("followed")


async def test_text_deltas_reach_redis_byte_for_byte(redis_space):
    """Events travel packed in one argument: lengths are bytes, whatever the text holds."""
    client, prefix = redis_space
    store = RedisRunStore(client, prefix=prefix)
    run = await new_run(store)
    chunks: list[Chunk] = [
        (b'{"d": "1 -1 0 "}', "1 -1 0 ", 0),  # text that reads like a packed header
        (b"{}", None, 0),  # not a text delta
        ('{"d": "ünï 日本 🙂"}'.encode(), "ünï 日本 🙂", 2),
        (b"{}", "", 1),
    ]
    assert await store.append(run, chunks) == 4
    assert await store.read(run, 0) == [
        (1, b'{"d": "1 -1 0 "}', "1 -1 0 ", 0),
        (2, b"{}", None, 0),
        (3, '{"d": "ünï 日本 🙂"}'.encode(), "ünï 日本 🙂", 2),
        (4, b"{}", "", 1),
    ]
    await store.close()
